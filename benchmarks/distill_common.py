"""Shared setup of the distillation benchmarks: the model, a demo-sized batch, timing and result files.

The batch is constructed (:mod:`lopd_core.algorithms.synthetic`): B trajectories rendered with the real
chat template (two assistant turns around a tool response, alternating rewards 1/0), each with J retrieved
experiences of ``experience_max_tokens`` tokens. Sizes default to the demo profile (B = 8, J = 2, K = 16,
depth 4, ≤ 256-token experiences, ≈ 1,024-token trajectories, top-M = 20, LoRA student).

With ``--episodes FILE`` (a JSONL of real episodes, e.g. what ``lopd probe-passk --out`` writes) the batch is
B of those instead, taken round-robin over the suite's domains as a training step's tasks are (so rollouts of
one domain share its system message and worked examples, as in training), with their real rewards; the
experiences are the file's other successes, of the same family where there is one.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_size_arguments(parser, *, quick_help: str) -> None:
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or path (default: the demo model)")
    parser.add_argument("--batch", type=int, default=None, help="B trajectories (default 8; --quick 2)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens per trajectory (default 600)")
    parser.add_argument("--reply-tokens", type=int, default=None, help="assistant tokens per trajectory (default 400)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median; default 3, --quick 2)")
    parser.add_argument("--episodes", type=Path, default=None,
                        help="JSONL of real episodes (`lopd probe-passk --out`): the batch is B of them, not synthetic")


def sizes(args) -> dict:
    quick = args.quick
    return {"batch": args.batch or (2 if quick else 8),
            "prompt_tokens": args.prompt_tokens or (200 if quick else 600),
            "reply_tokens": args.reply_tokens or (96 if quick else 400),
            "repeats": args.repeats or (2 if quick else 3),
            "experience_tokens": 128 if quick else 256,
            "episodes": str(args.episodes) if getattr(args, "episodes", None) else None}


def config_for(model: str, size: dict, **overrides):
    """The demo profile at the benchmark's sizes, on ``model``, CPU, LOPD; ``overrides`` are dotted fields."""
    from lopd_core.config import load_config

    return load_config("demo").with_overrides({
        "model.base": model, "model.device": os.environ.get("LOPD_BENCH_DEVICE", "auto"),
        "distill.tasks_per_step": size["batch"], "distill.lopd.experience_max_tokens": size["experience_tokens"],
        **overrides})


def models_dir() -> Path:
    from lopd_core.workspace import Workspace

    return Workspace.default().ensure().models_dir


def make_batch(tokenizer, size: dict, *, n_retrieved: int):
    """(trajectories, tasks, retrieved) for one step; rewards alternate 1/0 so the margin has both signs
    (real episodes and their rewards with ``size["episodes"]``)."""
    from lopd_core.algorithms.synthetic import experience_of, sized_trajectory, task_of

    if size.get("episodes"):
        return real_batch(Path(size["episodes"]), size["batch"], n_retrieved=n_retrieved)

    rows = [sized_trajectory(tokenizer, index=i, prompt_tokens=size["prompt_tokens"], reply_tokens=size["reply_tokens"],
                             reward=float(i % 2 == 0)) for i in range(size["batch"])]
    bank = [experience_of(sized_trajectory(tokenizer, index=10_000 + i, prompt_tokens=size["experience_tokens"] // 2,
                                           reply_tokens=size["experience_tokens"])) for i in range(2 * n_retrieved)]
    tasks = [task_of(r, oracle="The answer follows from the tool response.") for r in rows]
    retrieved = [[bank[(i + j) % len(bank)] for j in range(n_retrieved)] for i in range(len(rows))]
    return rows, tasks, retrieved


def real_batch(path: Path, batch: int, *, n_retrieved: int):
    """B episodes of ``path`` round-robin over domains, each with up to J other successes as experiences
    (same family first, then any)."""
    from itertools import zip_longest

    from lopd_core.algorithms.synthetic import experience_of, task_of
    from lopd_core.compare import read_episodes

    episodes = read_episodes([path])
    by_domain: dict[str, list] = {}
    for e in episodes:
        by_domain.setdefault(e.family.split("/")[0], []).append(e)
    mixed = [e for group in zip_longest(*by_domain.values()) for e in group if e is not None]
    rows = mixed[:batch]
    if len(rows) < batch:
        raise SystemExit(f"{path}: {len(rows)} episodes, the batch needs {batch}")
    chosen = {id(r) for r in rows}
    successes = [e for e in episodes if e.reward >= 0.8 and id(e) not in chosen]
    if len(successes) < n_retrieved:
        raise SystemExit(f"{path}: {len(successes)} successes outside the batch, {n_retrieved} experiences needed per rollout")
    retrieved = []
    for r in rows:
        ranked = [e for e in successes if e.family == r.family] + [e for e in successes if e.family != r.family]
        retrieved.append([experience_of(e) for e in ranked[:n_retrieved]])
    tasks = [task_of(r, oracle="The answer follows from the tool response.") for r in rows]
    return rows, tasks, retrieved


def timed(fn, *, repeats: int, warmup: int = 1) -> dict:
    """Run ``fn`` warmup + repeats times; the median of the timed runs (seconds) and each result."""
    for _ in range(warmup):
        fn()
    seconds, outputs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs.append(fn())
        seconds.append(time.perf_counter() - start)
    return {"median_s": statistics.median(seconds), "seconds": seconds, "outputs": outputs}


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_result(name: str, payload: dict, *, module: str = "") -> Path:
    """``benchmarks/results/<name>.json`` with the command (``python -m benchmarks.<module or name> …``)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "command": f"python -m benchmarks.{module or name} " + " ".join(sys.argv[1:]),
               "created": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(), **payload}
    from lopd_core.workspace import lopd_home, portable

    path.write_text(portable(json.dumps(payload, indent=2), lopd_home()) + "\n")  # no machine's directories
    return path
