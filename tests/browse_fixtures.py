"""Realistic tapes, run directories and call logs for the browser tests and its benchmark.

Hand-made dicts with the keys of `gsm8kctl.artifacts.tapes.make_tape` (no model, no grader): the outcome of
each attempt is chosen, and the completion, answers and reward are written to match it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. "
    "How much more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "Albert is wondering how much pizza he can eat in one day. He buys 2 large pizzas and 2 small pizzas. "
    "A large pizza has 16 slices and a small pizza has 8 slices. If he eats it all, how many pieces does he eat that day?",
]
GOLDS = ["72", "10", "5", "624", "48"]
OUTCOME_CYCLE = ("correct", "wrong", "correct", "unparsable", "wrong", "overflow", "correct", "wrong")
XSS = '<script>alert("xss")</script><img src=x onerror="alert(1)"> & "quotes" </pre></td>'


def completion_for(outcome: str, gold: str, rng: random.Random) -> tuple[str, str | None, str | None]:
    """(completion text, strict answer, lenient answer) for the chosen outcome."""
    g = int(gold)
    steps = [
        f"Let's break it down.\n1. First, **half** of it: $\\frac{{{2 * g}}}{{2}} = {g}$.",
        f"2. Then add: {g // 2} + {g - g // 2} = {g}.",
        "We can double-check with $x^2$-style reasoning: `ok`.",
    ]
    rng.shuffle(steps)
    body = "\n".join(steps)
    if outcome == "correct":
        return f"{body}\nThe final answer is \\boxed{{{gold}}}.", gold, gold
    if outcome == "wrong":
        wrong = str(g + rng.randint(1, 9))
        return f"{body}\nSo the answer is \\boxed{{{wrong}}}.", wrong, wrong
    if outcome == "unparsable":
        return f"{body}\nI am not sure how to finish this problem.", None, None
    # overflow: cut at max tokens in the middle of a sentence
    return f"{body}\n" + "Let me recompute this again carefully, " * 12 + "so the", None, str(g)


def fake_tape(*, iteration: int, split: str, problem_index: int, attempt: int, outcome: str,
              rng: random.Random, model: str = "smollm2-135m", tokenizer=None,
              completion: str | None = None, question: str | None = None, created: float = 1.7e9,
              n_completion_tokens: int | None = None) -> dict:
    q_i = problem_index % len(QUESTIONS)
    question = question if question is not None else QUESTIONS[q_i]
    gold = GOLDS[q_i]
    text, strict, lenient = completion_for(outcome, gold, rng)
    if completion is not None:
        text = completion
    problem_id = f"{split}-{problem_index:05d}"
    tid = f"{problem_id}-i{iteration:04d}-a{attempt:02d}-0a1b2c"
    if tokenizer is not None:
        completion_ids = tokenizer.encode(text).ids
        prompt_ids = tokenizer.encode(question).ids
    else:
        n = n_completion_tokens if n_completion_tokens is not None else max(1, len(text) // 4)
        completion_ids = [rng.randrange(49152) for _ in range(n)]
        prompt_ids = [rng.randrange(49152) for _ in range(40 + len(question) // 4)]
    # Mostly confident tokens, some unlikely ones, as a sampler at temperature 1 gives.
    logprobs = [round(-rng.expovariate(4.0) if rng.random() < 0.9 else -rng.uniform(1.0, 6.0), 6)
                for _ in completion_ids]
    correct = outcome == "correct"
    reward = 1.0 if correct else (0.0 if outcome == "wrong" else -1.0)
    reason = {
        "correct": f"\\boxed{{{strict}}} = gold {gold}",
        "wrong": f"\\boxed{{{strict}}} != gold {gold}",
        "unparsable": "no \\boxed{} answer and no number to read",
        "overflow": "cut at max tokens",
    }[outcome]
    return {
        "id": tid, "iteration": iteration, "split": split, "problem_id": problem_id, "attempt": attempt,
        "model": model, "question": question, "gold": gold,
        "steps": [{"kind": "question", "text": question},
                  {"kind": "reasoning", "text": text, "llm_call_id": f"call-{tid}"},
                  {"kind": "answer", "text": strict or lenient or ""}],
        "answer": {"strict": strict, "lenient": lenient, "format": strict is not None,
                   "correct_strict": correct, "correct_lenient": correct, "reason": reason},
        "correct": correct, "reward": reward,
        "finish_reason": "length" if outcome == "overflow" else "stop",
        "prompt_token_ids": prompt_ids, "completion_token_ids": completion_ids, "logprobs": logprobs,
        "n_messages": 2, "created": created,
    }


def call_for(tape: dict | None, i: int, created: float, *, call_id: str | None = None) -> dict:
    from gsm8kctl.artifacts.llm_calls import call_record

    question = tape["question"] if tape else QUESTIONS[i % len(QUESTIONS)]
    completion = tape["steps"][1]["text"] if tape else f"Reference call {i}: \\boxed{{{i}}}"
    messages = [{"role": "system", "content": "You are a careful math tutor."},
                {"role": "user", "content": question + "\nPlease reason step by step, and put your final "
                                                      "answer within \\boxed{}."}]
    return call_record(
        call_id=call_id or (tape["steps"][1]["llm_call_id"] if tape else f"extra-{i:06d}"),
        tape_id=tape["id"] if tape else f"not-a-tape-{i}", backend="transformers",
        model=tape["model"] if tape else "smollm2-135m", messages=messages,
        prompt_text="<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n",
        completion=completion, params={"temperature": 1.0, "top_p": 1.0, "max_tokens": 512, "seed": i},
        prompt_tokens=len(tape["prompt_token_ids"]) if tape else 80,
        completion_tokens=len(tape["completion_token_ids"]) if tape else 40,
        latency_s=0.25 + (i % 7) / 10, finish_reason=tape["finish_reason"] if tape else "stop", created=created,
    )


def write_jsonl(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


def make_run(root: Path, *, iterations: int = 2, problems: int = 6, attempts: int = 4,
             eval_problems: int = 5, extra_calls: int = 0, tokenizer=None, model: str = "smollm2-135m",
             seed: int = 0, calls: bool = True) -> dict:
    """A run directory as `loop` leaves it: iterations/NNNN/tapes.jsonl, eval/NNNN/tapes.jsonl,
    llm_calls.sqlite (one call per tape plus `extra_calls`), config.yaml and state.json."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("model: smollm2-135m\nattempts: 4\n")
    (root / "state.json").write_text(json.dumps({"iteration": iterations, "phase": "done"}))
    all_tapes: list[dict] = []
    t = 1.7e9
    k = 0
    for it in range(iterations):
        tapes = []
        for p in range(problems):
            for a in range(attempts):
                outcome = OUTCOME_CYCLE[(p * attempts + a + it) % len(OUTCOME_CYCLE)]
                t += 1
                tapes.append(fake_tape(iteration=it, split="train", problem_index=p + it * problems, attempt=a,
                                       outcome=outcome, rng=rng, tokenizer=tokenizer, model=model, created=t))
        write_jsonl(root / "iterations" / f"{it:04d}" / "tapes.jsonl", tapes)
        all_tapes += tapes
    ev = []
    for p in range(eval_problems):
        t += 1
        ev.append(fake_tape(iteration=iterations - 1, split="test", problem_index=p, attempt=0,
                            outcome=("correct", "wrong")[p % 2], rng=rng, tokenizer=tokenizer, model=model, created=t))
    if ev:
        write_jsonl(root / "eval" / f"{iterations - 1:04d}" / "tapes.jsonl", ev)
        all_tapes += ev
    n_calls = 0
    if calls:
        from gsm8kctl.artifacts.llm_calls import insert_calls, open_log

        db = open_log(root / "llm_calls.sqlite")
        records = [call_for(tp, i, tp["created"]) for i, tp in enumerate(all_tapes)]
        records += [call_for(None, i, 1.6e9 + i) for i in range(extra_calls)]
        insert_calls(db, records)
        db.conn.close()
        n_calls = len(records)
    return {"tapes": all_tapes, "n_calls": n_calls}


def train_tokenizer(out_dir: Path):
    """A tiny byte-level BPE tokenizer (offline), saved as out_dir/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_end|>"])
    corpus = QUESTIONS + [completion_for(o, g, random.Random(i))[0]
                          for i, (o, g) in enumerate(zip(OUTCOME_CYCLE * 3, GOLDS * 5))]
    tok.train_from_iterator(corpus, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok
