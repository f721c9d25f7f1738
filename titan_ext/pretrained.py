"""Loading a trained model to generate with it on any machine: ``from_pretrained(path)``.

An entry point beside training (as ``python -m titan_ext.plan`` is): it binds titan_ext's portable kernels to the
loaded model and keeps the libraries' notices, which ask nothing of the user, off the console.
"""

import types

import torch.nn as nn

from titan_ext import kernels


def from_pretrained(path, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)``, made ``portable``.

    Needed rather than ``portable(AutoModelForCausalLM.from_pretrained(...))``
    for fla's transformer without flash-attn: its Attention refuses to be
    built at all, so the build runs under ``host_patches.BUILD``. The load and
    the model's ``generate`` run with a quiet console (``host.job_patches.quiet_entry``):
    the libraries' import and deprecation notices ask nothing of the user.
    """
    from titan_ext.host.job_patches import quiet_entry
    from titan_ext.kernels.host_patches import building

    with quiet_entry():
        import fla  # noqa: F401  (registers fla's model types with transformers)
        from transformers import AutoModelForCausalLM

        with building():
            loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    kernels.portable(model)
    _quiet_generate(model)
    return loaded


def _quiet_generate(model: nn.Module) -> None:
    """This model's ``generate`` under ``host.job_patches.quiet_entry`` (fla's generation code warns at every call);
    a bound method, so that a copy of the model (``copy.deepcopy``) generates with itself."""
    model.generate = types.MethodType(_generate_quietly, model)


def _generate_quietly(self, *args, **kwargs):
    from titan_ext.host.job_patches import quiet_entry

    with quiet_entry():
        return type(self).generate(self, *args, **kwargs)
