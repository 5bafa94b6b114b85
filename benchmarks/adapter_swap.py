"""Publish + swap time of a LoRA adapter versus full weights on a served agent (issue 33 item 2).

    .venv/bin/python benchmarks/adapter_swap.py [--hidden 576] [--layers 30] [--repeats 10]

Builds the toy run (flexmarl/serving/toy.py) twice with a larger listener (a random Llama of
SmolLM2-135M's width and depth by default; nothing downloaded): once as a full-weight agent,
once with a LoRA adapter (r 8 on q_proj and v_proj, served unmerged). For each, `--repeats`
times, alternating the two so both see the same machine load, a new version goes the way a
separate online trainer's does (`flexmarl serve-learn`):

1. publish: the trainer packs what changed (the adapter alone, or every weight; FP16 + zstd,
   `compress.pack`) and writes the file;
2. load: the server builds the new version beside the served one (`AgentSpec.next_model`:
   a light copy sharing the base plus the adapter, or a deep copy plus the weights);
3. swap: the agent's engine is built over the new version and handed to its engine thread
   (`AgentWorker.swap`), timed until the thread serves it; then (reported apart, not in the
   total) one one-token request, answered by the new version.

Prints medians (ms) per phase, the bytes published, and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexmarl.policy.adapters import adapter_tensors  # noqa: E402
from flexmarl.serving.agents import Version, explicit_source, load_run  # noqa: E402
from flexmarl.serving.compress import pack  # noqa: E402
from flexmarl.serving.toy import make_toy_run, save_llama  # noqa: E402
from flexmarl.serving.worker import AgentWorker, Job, ServeRequest  # noqa: E402


def build_runs(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    run = make_toy_run(root)
    model_dir = root / "listener-model"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    save_llama(model_dir, vocab, seed=0, hidden=hidden, layers=layers)
    full, lora = root / "full", root / "lora"
    shutil.copytree(run, full)
    shutil.copytree(run, lora)
    cfg = yaml.safe_load((lora / "config.yaml").read_text())
    cfg["agents"]["listener"]["lora"] = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    (lora / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return full, lora


def served_version(worker: AgentWorker) -> int:
    """The version that admits a one-token request now (waits for its answer)."""
    done = threading.Event()
    out: list = []

    def sink(item: tuple) -> None:
        if item[0] in ("done", "error"):
            out.append(item)
            done.set()

    req = ServeRequest(sample_id=f"probe-{time.perf_counter_ns()}", agent=worker.agent,
                       version=0, prompt=[5, 9, 40], max_new_tokens=1, temperature=1.0,
                       noise_seed=1)
    worker.submit(Job(req, sink))
    done.wait(60)
    assert out and out[0][0] == "done", out
    return out[0][2].number


def one_swap(spec, worker: AgentWorker, folder: Path, i: int) -> dict[str, float]:
    t0 = time.perf_counter()
    if spec.adapter is not None:
        tensors = {k: v + 1e-3 * (i + 1) for k, v in adapter_tensors(spec.model,
                                                                     spec.adapter).items()}
    else:
        tensors = {k: v + 1e-3 * (i + 1) for k, v in spec.model.state_dict().items()}
    t_made = time.perf_counter()  # the trainer's tensors: not part of publication
    blob = pack(tensors)
    path = folder / f"v{i}.fmw"
    path.write_bytes(blob)
    t1 = time.perf_counter()
    model = spec.next_model(explicit_source(path))
    t2 = time.perf_counter()
    version = Version(spec.next_number(), path.name, None, time.time())
    worker.swap(model, version)
    while worker._current.version is not version:  # the engine thread took it
        time.sleep(0.0001)
    t3 = time.perf_counter()
    t_first = served_version(worker)  # and serves it: one request admitted by the new version
    assert t_first == version.number
    t4 = time.perf_counter()
    spec.model, spec.version = model, version
    path.unlink()
    del t0
    return {"bytes": len(blob), "publish": t1 - t_made, "load": t2 - t1, "swap": t3 - t2,
            "total": t3 - t_made, "first": t4 - t3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="adapter-swap-"))
    try:
        full_dir, lora_dir = build_runs(root, args.hidden, args.layers)
        parts = {}
        for kind, run_dir in (("full weights", full_dir), ("LoRA adapter", lora_dir)):
            spec = load_run(run_dir, "cpu", ["listener"]).agents["listener"]
            worker = AgentWorker("listener", spec.model, spec.version, 8, 4096, spec.adapters)
            served_version(worker)  # warm
            parts[kind] = (spec, worker)
        params = sum(p.numel() for p in parts["full weights"][0].model.parameters())
        results: dict[str, list[dict[str, float]]] = {k: [] for k in parts}
        for i in range(args.repeats):
            for kind, (spec, worker) in parts.items():
                results[kind].append(one_swap(spec, worker, root, i))
        for _, worker in parts.values():
            worker.stop()
        print(f"listener: random Llama, hidden {args.hidden}, {args.layers} layers, "
              f"{params / 1e6:.1f}M parameters; LoRA r 8 on q_proj, v_proj; CPU; "
              f"{args.repeats} swaps each, alternating; load average "
              f"{os.getloadavg()[0]:.1f}")
        print()
        print("| publication | bytes published | publish (pack + write) ms | load ms | "
              "swap ms | total ms | then a one-token request ms |")
        print("|---|---|---|---|---|---|---|")
        for kind, rows in results.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"| {kind} | {int(med['bytes']):,} | {1e3 * med['publish']:.1f} | "
                  f"{1e3 * med['load']:.1f} | {1e3 * med['swap']:.1f} | "
                  f"{1e3 * med['total']:.1f} | {1e3 * med['first']:.1f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
