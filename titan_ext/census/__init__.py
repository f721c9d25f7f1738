"""``python -m titan_ext.census``: every causal-LM model type transformers and fla register, trained through titan_ext.

For each decoder-only text causal LM model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the
others are listed with their reason: ``model_types.left_out_reason``), and each of fla's model
types, the census derives a tiny config from the type's own config class (``configs.tiny_config``) and
writes one Markdown row:

- **layers' mixers**: the token mixer titan_ext found at each layer of the model its train spec builds
  (``cells.layer_mixers_of``);
- **one process**: one training step as a user runs it, torchtitan's own ``Trainer`` through
  ``torchtitan.train.main`` with ``--model.name hf`` (``fla``) ``--titan_ext.hf_config <tiny config.json>``
  (``train_configs/debug_llama.toml``, seq_len 64, batch 2, fp32, 1 step, no checkpoint, no validation, seed
  0 and torch's deterministic mode, which also fills uninitialized memory with NaN: a parameter that
  ``init_weights`` leaves uninitialized fails the step every time, not now and then):
  ``ok``, titan_ext's one-line refusal, or ``TRACEBACK: <type>: <first line>`` when the job died otherwise
  (a bug), or ``TIMEOUT``;
- **FSDP2, TP, CP, PP, EP, documents**: whether titan_ext *plans* the job under that layout on 2 ranks
  (documents: one) without launching any: the checks a job runs before its build (preflight, then
  ``update_from_config``, which plans the job against a meta-device model), as ``plans`` or the refusal. EP
  is ``n/a`` for a model without experts. These columns say "planned", not "ran": the integration matrix
  runs one model per mixer kind for real.

The last line is ``N of M model types train`` (transformers' types), after ``fla: N of M model types train``.

How it runs (measured on the 2-core CI machine: the whole census in about 40 s with 2 workers unloaded, about
0.3 s of work per type; the budget is 3 minutes): jobs run in ``--jobs`` worker processes forked from this one
once it has imported torch, torchtitan and transformers, so a job costs its own work, not the 5-15 s of imports
of a fresh process; each worker takes one type after another, with the cleanup the integration matrix does
between jobs (``tests/matrix_driver.py``). Each job is torchtitan's real ``Trainer`` and titan_ext's train spec
(``update_from_config`` and the job plan, the spec's model, ``parallelize_fn``, ``init_weights``, forward, the
spec's loss, backward, the optimizer step); what the census trims: the job config is parsed once per worker
(tyro's parse costs about 0.4 s, seven times a type) and each job gets a copy with its own config file and
dump folder (what parsing those flags gives; ``cells.job_config``), and torchtitan's 2 s sleep after training "for
other ranks" is skipped (there are none). Importing fla registers fla's ``mamba``, ``mamba2`` and ``bitnet``
under transformers' names (and titan_ext's TP plans and some transformers modeling files import fla): a
transformers type whose name a worker's fla import took over runs in a fresh worker (``shadowed``), as in a
user's fresh process. A step that runs ``--timeout`` seconds of its worker's CPU time (or sits 10 times that
long on the wall clock: a deadlock uses no CPU) ends its worker: that cell is ``TIMEOUT`` and the type's cells
after it ``not run``. CPU time, not the wall clock, so that a loaded machine (CI runs the integration matrix
beside the tests) does not turn a slow step into a ``TIMEOUT``. Timings go to stderr, never into the table.

The modules, by what they hold: ``model_types`` (which types) and ``configs`` (each one's tiny config);
``columns`` (the table's columns and what each stands for); ``cells`` (one type's cells: its build, plans and
training step); ``workers`` (the processes that run the types); ``matrix`` (the integration matrix's runs behind
the multi-rank cells); ``table`` (the Markdown and ``--check``); ``__main__`` (the command).
"""
