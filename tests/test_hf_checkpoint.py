"""HF checkpoints: the config check before a job loads one.

Export and import through torchtitan are the integration matrix's ``hf`` rows
(``tests/test_integration_matrix.py`` also loads each exported folder with
``from_pretrained`` and generates from it).
"""

import pytest
from torchtitan.protocols.train_spec import get_train_spec

import titan_ext  # noqa: F401  (train specs)
from titan_ext.checkpoints.hf import check_hf_config, checkpoint_config
from titan_ext.errors import ConfigError

SPECS = ["fla_gla", "fla_transformer", "hf_llama"]


@pytest.mark.parametrize("spec", SPECS)
def test_config_check_names_each_differing_field(spec, tmp_path):
    args = get_train_spec(spec).model_args["debugmodel"]
    config = checkpoint_config(args)
    config.num_hidden_layers += 1
    config.vocab_size *= 2
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as error:
        check_hf_config(args, str(tmp_path))
    message = str(error.value)
    assert "num_hidden_layers=2 (flavor) vs 3 (checkpoint)" in message and "vocab_size=2048 (flavor) vs 4096" in message
    assert "hidden_size" not in message, message
    checkpoint_config(args).save_pretrained(tmp_path)
    check_hf_config(args, str(tmp_path))  # a matching directory passes


def test_an_export_carries_the_tokenizer_modules_its_config_names(tmp_path):
    """A custom tokenizer (Kimi's: ``auto_map`` -> ``tokenization_kimi.py``, ``tiktoken.model``) is carried whole:
    transformers' AutoTokenizer loads it from those files, as from the hub folder."""
    import json

    from titan_ext.checkpoints.hf import tokenizer_files

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    for name in ("tokenization_kimi.py", "tiktoken.model", "tokenizer.json", "modeling_other.py"):
        (tmp_path / name).write_text("")
    assert sorted(tokenizer_files(str(tmp_path))) == [
        "tiktoken.model", "tokenization_kimi.py", "tokenizer.json", "tokenizer_config.json"]
