"""The continued-pretraining walkthrough, read out of docs/checkpoints-and-hf.md so the tests run what the page shows.

Its section "Continued pretraining from a hub checkpoint" holds one subsection per model (``### ...``), each with
one ```` ```bash ```` block per step: ``hf download REPO --local-dir checkpoints/NAME``, ``python -m titan_ext.plan``
(its output in the ```` ```text ```` block after it) and ``torchrun ... -m torchtitan.train``; then one
```` ```python ```` block that loads an export.

The 8-GPU commands run on 2 CPU ranks (the integration matrix's ``walkthrough`` row) with these changes, and no
other (``cpu_argv``): the hub folder is a tiny ``save_pretrained`` folder of the same model type; every 8
(``--nproc_per_node`` and each parallel degree) is 2; the user's text shards are the matrix's corpus
(``titan_ext_tiny``, which every data-parallel rank reads alike); and ``CPU_FLAGS`` follow, for a short fp32 run
whose step 1 is comparable with transformers' own forward.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "checkpoints-and-hf.md"
SECTION = "## Continued pretraining from a hub checkpoint"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
FOLDER = re.compile(r"--local-dir (\S+)")
GPUS = "8"
CPU_RANKS = "2"
USER_DATA = ("--training.dataset", "--training.dataset_path")
CPU_FLAGS = (
    "--training.mixed_precision_param", "float32",  # transformers' reference forward runs in fp32
    "--checkpoint.export_dtype", "float32",  # the tiny folders are fp32: so is their export
    "--titan_ext.no-document_mask",  # transformers' forward sees each window whole
)
"""What the CPU run adds to the page's command, after the integration matrix's short-run flags."""
PLAN_ONLY = ("--world",)
TRAIN_ONLY = ("--model.hf_assets_path", "--checkpoint.", "--job.dump_folder", *USER_DATA, "--training.steps")
"""Flags only one of the two commands has: the plan sizes the layout, the data and the length are the run's."""


@dataclass(frozen=True)
class Model:
    """One subsection: a model's download, plan (and its output as shown) and training command."""

    title: str
    repo: str
    folder: str
    """The download's ``--local-dir``, as the plan and training commands name it."""
    plan: list[str]
    """The planner's arguments after ``-m titan_ext.plan``."""
    plan_output: str
    train: list[str]
    """The training command's arguments after ``-m torchtitan.train``."""
    world: int


def section(text: str) -> str:
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end > 0 else len(text)]


def _words(body: str) -> list[str]:
    return shlex.split(body.replace("\\\n", " "))


def _model(title: str, text: str) -> Model:
    blocks = FENCE.findall(text)
    bash = [_words(body) for language, body in blocks if language == "bash"]
    downloads = [w for w in bash if w[:2] == ["hf", "download"]]
    plans = [w for w in bash if w[:3] == ["python", "-m", "titan_ext.plan"]]
    trains = [w for w in bash if w[:1] == ["torchrun"]]
    outputs = [body for (language, body), (before, _) in zip(blocks[1:], blocks) if language == "text" and before == "bash"]
    if not (len(downloads) == len(plans) == len(trains) == len(outputs) == 1):
        raise ValueError(f"{PAGE.name}: {title!r} must hold one download, one plan with its output and one torchrun")
    (download,), (plan,), (train,) = downloads, plans, trains
    world = int(next(w.split("=")[1] for w in train if w.startswith("--nproc_per_node=")))
    return Model(title, download[2], download[download.index("--local-dir") + 1], plan[3:], outputs[0],
                 train[train.index("torchtitan.train") + 1:], world)


def models(page: Path = PAGE) -> list[Model]:
    """The walkthrough's models, in the page's order."""
    parts = re.split(r"^### (.+)$", section(page.read_text()), flags=re.M)
    return [_model(title, text) for title, text in zip(parts[1::2], parts[2::2]) if "hf download" in text]


def model_of(repo_name: str, page: Path = PAGE) -> Model:
    """The subsection that downloads ``repo_name`` (e.g. ``Qwen3-30B-A3B``)."""
    return next(model for model in models(page) if model.repo.split("/")[1] == repo_name)


def load_example(page: Path = PAGE) -> tuple[str, str]:
    """(the python block that loads an export, the export folder it names)."""
    (body,) = [body for language, body in FENCE.findall(section(page.read_text())) if language == "python"]
    return body, re.search(r'"(outputs/[^"]+)"', body).group(1)


def _degree(flag: str) -> bool:
    return flag.startswith("--parallelism.") and flag.endswith("_degree")


def _substituted(argv: list[str], folder: str, tiny: str) -> list[str]:
    """The hub folder as the tiny one, every 8-way degree as 2, the user's data flags dropped."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word in USER_DATA:
            skip = True
            continue
        if word == GPUS and i and _degree(argv[i - 1]):
            word = CPU_RANKS
        out.append(tiny if word == folder else word)
    return out


def cpu_argv(model: Model, tiny: Path) -> list[str]:
    """The training command's arguments for 2 CPU ranks (before the matrix's own flags and ``CPU_FLAGS``), the
    TOML's path from the repository's root, where the page's commands run."""
    argv = _substituted(model.train, model.folder, str(tiny))
    i = argv.index("--job.config_file") + 1
    return [*argv[:i], str(PAGE.parents[1] / argv[i]), *argv[i + 1:]]


def plan_argv(model: Model, folder: Path) -> list[str]:
    """The plan command's arguments with the hub folder at ``folder`` (holding the real config.json)."""
    return [str(folder) if word == model.folder else word for word in model.plan]


def flags(argv: list[str], drop: tuple[str, ...]) -> list[tuple[str, str]]:
    """(flag, value) pairs of ``argv`` (a bare flag's value ''), less those starting with any of ``drop``."""
    pairs, i = [], 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        if not argv[i].startswith(drop):
            pairs.append((argv[i], value))
        i += 2 if value else 1
    return pairs
