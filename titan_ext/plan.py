"""``python -m titan_ext.plan --job.config_file X.toml [torchtitan/titan_ext flags] --world N``

Plans a job without its ranks (``titan_ext.planner``): per rank, the parameters, gradients and optimizer
state it holds, its activations, the collectives one step issues, the pipeline bubble and the time the
collectives alone take at ``--link-gbps``. ``--sweep`` tries every layout of N ranks and lists those that fit
``--memory-gib``, fastest first by that bound. Not imported by ``import titan_ext``.
"""

from __future__ import annotations

import argparse
import sys
import time



def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m titan_ext.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--world", type=int, required=True, help="ranks in the job")
    parser.add_argument("--link-gbps", type=float, default=50.0,
                        help="GB/s each rank sends at, for the collectives' time (default 50: a 400 Gb/s NIC)")
    parser.add_argument("--sweep", action="store_true", help="every layout of --world ranks that fits --memory-gib")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="memory per rank, for --sweep (default 80)")
    return parser.parse_known_args(argv)


def layout_name(dims) -> str:
    names = [("pp", dims.pp), ("dp_replicate", dims.dp_replicate), ("fsdp", dims.dp_shard), ("cp", dims.cp), ("tp", dims.tp)]
    name = " x ".join(f"{name} {degree}" for name, degree in names if degree > 1) or "1 rank"
    return name + (f", experts over ep {dims.ep}" if dims.ep > 1 else "")


def describe(planned, job_config, link_gbps: float) -> str:
    """The report for one layout: ``planned`` holds one RankPlan per role (each pipeline stage's first rank)."""
    from titan_ext.planner import estimates
    from titan_ext.planner.collectives import summary
    from titan_ext.planner.memory import GIB, MIB

    first = planned[0]
    training, ac = job_config.training, job_config.activation_checkpoint
    passes = estimates.accumulation_steps(job_config, first.parallel_dims)
    lines = [
        f"{job_config.model.name} {job_config.model.flavor} on {first.parallel_dims.world_size} ranks: "
        f"{layout_name(first.parallel_dims)} ({first.plan.data_parallel.kind}); local batch {training.local_batch_size} "
        f"x seq {training.seq_len}, {passes} pass(es) per step, AC {ac.mode}, params {training.mixed_precision_param} "
        f"in FSDP's forward",
        "",
        "per rank, GiB        params     grads  optimizer      saved  step peak     total",
    ]
    for rank in planned:
        who = f"rank {rank.rank}" + (f" (stages {','.join(map(str, rank.stages))})" if rank.stages else "")
        figures = (rank.param_bytes, rank.grad_bytes, rank.optimizer_bytes, rank.saved_bytes, rank.peak_bytes, rank.total_bytes)
        lines.append(f"{who:<18}" + "".join(f"{b / GIB:>{w}.3f}" for b, w in zip(figures, (10, 10, 11, 11, 11, 10))))
    lines += [
        "  params, grads, optimizer: exact, the local shards of the sharded tensors (optimizer: after one step).",
        "  saved: what autograd saved in one forward pass of the local batch (parameters and FSDP's gathered",
        "  weights excepted; under AC what checkpointed blocks keep), recorded under FakeTensorMode.",
        "  step peak: the most the step's own tensors held at once, each from its allocation to its release:",
        "  the saved tensors and backward's transients (the logits' gradient, a loss chunk, the recomputed",
        "  block under AC), FSDP's gathered weights, the collectives' buffers, and the gradients from where",
        "  backward computes each (FSDP's unsharded ones until their reduce-scatter). Not counted: the",
        "  allocator's fragmentation and caching, kernels' workspaces, the process's own memory.",
        "  total: params + optimizer + step peak (the gradients are in the step peak).",
        *(["  under PP: saved is summed over all the step's microbatches, as if all were in flight (a bound); the",
           "  step peak follows the schedule, which frees each microbatch's at its backward"]
          if first.plan.pp else []),
        "",
    ]
    bubble = (f"pipeline bubble: {estimates.bubble(first.plan, job_config):.1%}"
              + (f" ({first.plan.pp.schedule}, {len(first.plan.pp.stages)} stages, "
                 f"{training.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size} microbatches; "
                 "(p - 1) / (stages per rank x microbatches + p - 1))" if first.plan.pp else " (no pipeline)"))
    for rank in planned:  # under PP each stage's ranks issue their own: one table per stage
        lines += [
            f"collectives of one forward-backward pass, rank {rank.rank} (recorded on a fake process group):",
            "  kind            group                     ranks   count        MiB   sent MiB",
        ]
        for kind, group, ranks, count, total in summary(list(rank.collectives)):
            sent = sum(c.wire_bytes() for c in rank.collectives if (c.kind, c.group, c.ranks) == (kind, group, ranks))
            lines.append(f"  {kind:<15} {group:<25} {ranks:>5} {count:>7} {total / MIB:>10.1f} {sent / MIB:>10.1f}")
    seconds = estimates.step_seconds(planned, link_gbps, passes)
    lines += [
        "  (sent: what each rank sends in ring algorithms, and a pipeline's sends; the step's scalar all-reduces",
        "  outside forward and backward, token count and gradient norm, are not included)",
        "",
        bubble,
        f"collectives alone: {seconds * 1e3:.1f} ms per step at {link_gbps:g} GB/s per rank ({passes} pass(es); no "
        "overlap, no latency" + (", the busiest stage's ranks" if len(planned) > 1 else "") + ": a lower bound on the step time)",
    ]
    return "\n".join(lines)


KERNELS = ("planned in CPU mode, on titan_ext's portable torch kernels: on a GPU, fla's Triton kernels and torch's "
           "fused attention save other tensors for backward, so activations there can differ (parameters, gradients, "
           "optimizer state and collectives do not)")


def check_kernels(job_config) -> None:
    """fla's Triton kernels cannot run where the planner runs: a fake process group and FakeTensorMode, in CPU
    mode (Triton's interpreter computes on real arrays; a GPU's kernels are not reachable from it)."""
    from titan_ext.errors import ConfigError

    if getattr(getattr(job_config, "titan_ext", None), "kernels", "auto") == "fla":
        raise ConfigError(
            "--titan_ext.kernels='fla': the planner cannot run fla's Triton kernels (it plans on fake tensors in CPU "
            "mode, where neither a GPU nor Triton's interpreter can run them); plan with --titan_ext.kernels auto: "
            "it plans titan_ext's portable kernels (parameters, gradients, optimizer state and collectives as with "
            "fla's; the activations fla's kernels save on a GPU can differ)"
        )


def main(argv: list[str] | None = None) -> int:
    options, rest = parse(sys.argv[1:] if argv is None else argv)
    from titan_ext.planner import job_config_of, prepare

    prepare()
    from titan_ext.errors import ConfigError
    from titan_ext.planner.roles import plan_layout

    begin = time.monotonic()
    try:
        check_kernels(job_config_of(rest))
    except ConfigError as error:
        print(f"titan_ext: {error}", file=sys.stderr)
        return 2
    if options.sweep:
        from titan_ext.planner import layouts

        print(layouts.sweep(rest, options.world, options.memory_gib, options.link_gbps,
                            progress=lambda line: print(line, file=sys.stderr, flush=True)))
    else:
        try:
            planned = plan_layout(job_config_of(rest), options.world)
        except ConfigError as error:
            print(f"titan_ext: {error}", file=sys.stderr)
            return 2
        print(describe(planned, job_config_of(rest), options.link_gbps))
    print(f"\n{KERNELS}")
    print(f"planned in {time.monotonic() - begin:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
