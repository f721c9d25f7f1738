"""fla and HF Llama-style models for stock torchtitan 0.2.x.

Importing this package, through ``[experimental] custom_import = "titan_ext"``,
registers its train specs and datasets with torchtitan, routes fla's Triton
kernels to torch implementations for non-CUDA tensors, lets fla's softmax
attention run on PyTorch SDPA when flash-attn is missing, and, when the machine
has no accelerator, points torchtitan at the CPU and gloo.
"""

from titan_ext import kernels
from titan_ext.cpu_mode import enable_cpu_mode
from titan_ext.data import register_datasets
from titan_ext.models import sdpa_attention
from titan_ext.train_specs import TRAIN_SPECS, register_train_specs

kernels.install()
sdpa_attention.install()
enable_cpu_mode()
register_datasets()
register_train_specs()

__all__ = ["TRAIN_SPECS"]
