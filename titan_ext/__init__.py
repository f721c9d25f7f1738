"""fla and HF Llama-style models for stock torchtitan 0.2.x.

``import titan_ext`` registers titan_ext's train specs and its shipped dataset
with torchtitan, and changes nothing else. When torchtitan's ``Trainer``
imports it as ``[experimental] custom_import``, it also sets up that job
(``titan_ext.host.job.on_trainer_import``): checks the config, and on a machine
without an accelerator points torchtitan at the CPU. Every change to a host
library is a row of a table in one of ``titan_ext.patching.TABLE_MODULES``.
"""

from titan_ext.data import register_datasets
from titan_ext.host import job
from titan_ext.train_specs import TRAIN_SPECS, register_train_specs

register_datasets()
register_train_specs()
job.on_trainer_import()

__all__ = ["TRAIN_SPECS"]
