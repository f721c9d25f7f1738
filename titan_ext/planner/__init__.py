"""Plan a titan_ext job without its ranks (``python -m titan_ext.plan``).

One process stands in for any rank of an N-rank job: a fake process group of
world size N (collectives return at once, nothing moves), the model built on the
meta device and parallelized by the train spec's own functions, then one
training step's forward and backward run under ``FakeTensorMode`` (shapes and
dtypes, no storage). What each rank holds is read from its sharded tensors and
what the step communicates is recorded as it is issued: nothing is a formula
except the activation, bubble and bandwidth figures, which say their
assumptions. Not imported by ``import titan_ext``.
"""
