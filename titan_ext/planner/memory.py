"""What a rank holds, read from its tensors' local shards (planned and real runs alike)."""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from titan_ext.planner import host_patches
from titan_ext.planner.collectives import Watcher

GIB, MIB = 2**30, 2**20


def local_bytes(tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def param_bytes(model_parts) -> int:
    return sum(local_bytes(p) for part in model_parts for p in part.parameters())


def grad_bytes(model_parts) -> int:
    return sum(local_bytes(p.grad) for part in model_parts for p in part.parameters() if p.grad is not None)


def optimizer_bytes(optimizers) -> int:
    """Every tensor of every optimizer's state (AdamW: both moments and the step counter)."""
    return sum(
        local_bytes(value)
        for optimizer in optimizers.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class StepPeak(Watcher):
    """The most bytes a step's own tensors hold at once (seeing each operator: planned and real runs alike).

    Every tensor an operator allocates inside ``with peak:`` is counted from its allocation until its storage
    is freed (a weak reference on the storage: what autograd saves, the transients of backward such as the
    logits' gradient, FSDP's gathered weights, the collectives' buffers), each storage once. The gradients are
    such tensors: each counted from the operator of backward that computes it when autograd reaches its
    parameter (autograd keeps that output as ``.grad``), FSDP's unsharded one until its reduce-scatter frees
    it, then the sharded one to the step's end (``step_peak_bytes``). Memory held before the step (parameters,
    optimizer state, the batch) is not in it; nor is the allocator's fragmentation, nor kernels' workspaces
    that never reach torch's dispatcher."""

    def __init__(self):
        self._paused = False
        self.events: list[tuple[int, int]] = []
        """(allocation number, +bytes) at each allocation, (allocation number, -bytes) at its storage's release."""
        self._live: dict[int, tuple[int, int, weakref.ref]] = {}
        """storage address -> (allocation number, bytes, a weak reference that reports its release)."""
        self.tag_of = lambda tensor: None
        """What each allocated tensor is tagged with as it is made (a pipelined step's microbatch: ``planner.microbatches``)."""
        self._tags: dict[int, object] = {}
        self.inherited = lambda tag: True
        """Whether a tensor computed from tensors tagged ``tag`` only, outside any tag, takes it."""
        self.last_tagged: dict[object, int] = {}
        """Tag -> the number of the last allocation ``tag_of`` tagged with it (while its microbatch runs)."""

    def dispatched(self, args, kwargs, out) -> None:
        """Each tensor ``out`` holds in a storage neither live (a view, or an operator that wrote in place) nor an
        input's (a view or an in-place result of a tensor made before the step) is an allocation."""
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (list, tuple)):
            outs = list(_tensors(out))
        else:
            return
        inputs = None
        for tensor in outs:
            key = tensor.untyped_storage()._cdata
            if key in self._live:
                continue
            if inputs is None:
                inputs = {t.untyped_storage()._cdata for t in _tensors(args)}
                if kwargs:
                    inputs.update(t.untyped_storage()._cdata for t in _tensors(kwargs.values()))
            if key not in inputs:
                self._allocated(tensor, inputs)

    def _allocated(self, tensor: torch.Tensor, inputs=()) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:  # a view, or an operator that wrote in place
            return
        number, size = len(self.events), storage.nbytes()
        self._tags[number] = self._tag(tensor, inputs, number)
        self._live[key] = (number, size, weakref.ref(storage, lambda _, key=key: self._released(key)))
        self.events.append((number, size))

    def _tag(self, tensor, inputs, number: int) -> object:
        """``tag_of(tensor)``, or where that is None the one tag of the inputs' allocations (a tensor computed
        from one microbatch's after its microbatch, as a pipeline schedule's losses are scaled at the step's end)."""
        tag = self.tag_of(tensor)
        if tag is not None:
            self.last_tagged[tag] = number
        else:
            tags = {self._tags[self._live[key][0]] for key in inputs if key in self._live}
            tags = {tag for tag in tags if tag is not None and self.inherited(tag)}
            tag = tags.pop() if len(tags) == 1 else None
        return tag

    def _released(self, key: int) -> None:
        number, size, _ = self._live.pop(key)
        self.events.append((number, -size))

    def resized(self, storage) -> None:
        """FSDP frees a gathered weight's memory by resizing its storage to 0 and gathers into it again by
        resizing it back (``UntypedStorage.resize_``, which no operator dispatch sees; ``host_patches.STORAGE_RESIZES``
        tells)."""
        held = self._live.get(storage._cdata)
        if held is not None and held[1] != storage.nbytes():
            number, size, ref = held
            self._live[storage._cdata] = (number, storage.nbytes(), ref)
            self.events.append((number, storage.nbytes() - size))

    def peak_bytes(self, kept: list[torch.Tensor] = ()) -> int:
        """The largest sum of live bytes, less the allocations that ``kept`` (the gradients) still hold."""
        return self._peak(kept)[0]

    def peak_event(self, kept: list[torch.Tensor] = ()) -> int:
        """The last event at which the live bytes were ``peak_bytes(kept)``."""
        return self._peak(kept)[1]

    def held(self, index: int, kept: list[torch.Tensor] = ()) -> dict[object, dict[int, int]]:
        """Tag -> {allocation number: bytes} of its allocations live just after event ``index`` (less ``kept``'s)."""
        left_out, sizes = self._left_out(kept), Counter()
        for number, size in self.events[: index + 1]:
            if number not in left_out:
                sizes[number] += size
        held: dict[object, dict[int, int]] = {}
        for number, size in sizes.items():
            if size:
                held.setdefault(self._tags.get(number), {})[number] = size
        return held

    def sizes(self, kept: list[torch.Tensor] = ()) -> list[int]:
        """Each event's bytes, in order (0 for an allocation ``kept`` holds): their running sum is the live bytes."""
        left_out = self._left_out(kept)
        return [0 if number in left_out else size for number, size in self.events]

    def tag(self, number: int) -> object:
        """What allocation ``number`` was tagged with (None: untagged)."""
        return self._tags.get(number)

    def _left_out(self, kept) -> set[int]:
        left_out = set()
        for tensor in kept:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            held = self._live.get(local.untyped_storage()._cdata)
            if held is not None:
                left_out.add(held[0])
        return left_out

    def _peak(self, kept) -> tuple[int, int]:
        left_out = self._left_out(kept)
        now = peak = at = 0
        for index, (number, size) in enumerate(self.events):
            if number not in left_out:
                now += size
                if now >= peak:
                    peak, at = now, index
        return peak, at

    def __enter__(self):
        self._counted = host_patches.counting(self)
        self._counted.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._counted.__exit__(None, None, None)
        return super().__exit__(*exc)


def _tensors(values):
    """The tensors among ``values`` and in their lists and tuples (where an operator's arguments and results
    hold them)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def gradients(model_parts) -> list[torch.Tensor]:
    return [p.grad for part in model_parts for p in part.parameters() if p.grad is not None]


def held_through(model_parts, passes: int) -> list[torch.Tensor]:
    """The gradients a pass of the step holds from its start: none where the step is one pass (torchtitan's
    ``zero_grad`` freed them); every one where it accumulates several (from the second pass on)."""
    return gradients(model_parts) if passes > 1 else []


def step_peak_bytes(peak: StepPeak, model_parts, passes: int = 1) -> int:
    """The step's peak after its forward and backward under ``peak``: one pass's own tensors with the
    gradients where backward allocates them; an accumulating step's later passes run beside every gradient
    (each later pass's new gradient, added in place and freed, is left out: one parameter's at a time)."""
    held = held_through(model_parts, passes)
    return peak.peak_bytes(held) + sum(local_bytes(g) for g in held)
