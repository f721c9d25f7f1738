"""Checks of the inputs a user hands a job: ``jsonl`` files, ``hf_config`` fields, numbers
and parallel ``degrees``, registry ``names``, the ``tokenizer`` folder (checkpoints: ``titan_ext.checkpoints``).

Each check is pure and fast (no model, no tensor loads, no process group) and
runs before any expensive work. A bad input raises ``ConfigError`` with one
line: the option and its value, what is wrong, and after a semicolon the fix.
torchtitan would otherwise fail late (after building and sharding the model,
or mid-load) with an assert, a ``KeyError`` or an unpickling traceback.
"""
