"""Token strings for the per-token logprob shading of a completion.

A tape stores token ids and the sampler's logprobs, not token strings. When a tokenizer for the
tape's model is on local disk (a checkpoint or model directory with `tokenizer.json`, the
embedded model's converted cache, a Hugging Face hub cache), we load it with the `tokenizers`
library (fast, no transformers import), cache it, and cut the decoded completion into per-token
pieces. Nothing is downloaded. When no tokenizer is found, or the pieces do not reassemble into
the decoded text exactly, the page shows the completion unshaded.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from pathlib import Path

MAX_TOKENS_SHADED = 8192
# How many earlier tokens give context when decoding one token: enough for byte-level BPE to
# finish a multi-byte character and for sentencepiece to keep a leading space.
_CONTEXT = 4
_CACHE_SIZE = 4

# Probability buckets for shading (class p0 = confident .. p4 = unlikely).
_BUCKETS = (0.9, 0.5, 0.2, 0.05)


def bucket(logprob: float | None) -> int:
    """0 for p >= 0.9, then 1..4 for ever less likely tokens."""
    if logprob is None or not isinstance(logprob, (int, float)) or math.isnan(logprob):
        return 0
    p = math.exp(min(0.0, float(logprob)))
    for i, edge in enumerate(_BUCKETS):
        if p >= edge:
            return i
    return len(_BUCKETS)


class TokenizerFinder:
    """Finds and caches tokenizers by model name; `forced` (a dir or tokenizer.json) wins."""

    def __init__(self, search_roots: list[Path], forced: str | Path | None = None):
        self.search_roots = search_roots
        self.forced = Path(forced) if forced else None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def candidates(self, model: str | None) -> list[Path]:
        if self.forced is not None:
            return [self.forced]
        if not model or not isinstance(model, str) or len(model) > 4096:
            return []
        out: list[Path] = []
        try:
            from gsm8kctl.artifacts.models import EMBEDDED, cache_dir

            if model in EMBEDDED:
                out.append(cache_dir() / "models" / model)
        except ImportError:  # pragma: no cover - models is part of the package
            pass
        p = Path(model).expanduser()
        if p.is_absolute():
            out.append(p)
        else:
            # Relative model paths are relative to where the run was launched: try the current
            # directory, then the run directory and a few of its parents.
            out.append(Path.cwd() / p)
            for root in self.search_roots:
                out.append(root / p)
                out.extend(parent / p for parent in list(root.parents)[:3])
            if model.count("/") == 1 and not model.startswith("."):
                hub = Path(os.environ.get("HF_HUB_CACHE") or
                           Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
                snaps = hub / ("models--" + model.replace("/", "--")) / "snapshots"
                if snaps.is_dir():
                    out.extend(sorted(snaps.iterdir(), reverse=True))
        return out

    def get(self, model: str | None):
        """A `tokenizers.Tokenizer` for this model, or None."""
        key = str(self.forced) if self.forced is not None else str(model)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tok = None
        for cand in self.candidates(model):
            file = cand if cand.name == "tokenizer.json" else cand / "tokenizer.json"
            try:
                if file.is_file():
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_file(str(file))
                    break
            except Exception:  # a broken tokenizer file: try the next candidate
                continue
        with self._lock:
            self._cache[key] = tok
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return tok


def token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int, str]] | None:
    """[(first token, end token, text)] covering `ids`; None if decoding does not line up.

    A span is usually one token; tokens that end inside a multi-byte character are merged with
    the following ones until the character is complete.
    """
    if not ids or len(ids) > MAX_TOKENS_SHADED:
        return None
    try:
        # An id past the vocabulary means this is not the tokenizer that sampled these tokens
        # (decode would silently drop it).
        if max(ids) >= tokenizer.get_vocab_size(with_added_tokens=True) or min(ids) < 0:
            return None
        full = tokenizer.decode(ids, skip_special_tokens=False)
        spans: list[tuple[int, int, str]] = []
        start = 0
        n = len(ids)
        for i in range(n):
            lo = max(0, start - _CONTEXT)
            prefix = tokenizer.decode(ids[lo:start], skip_special_tokens=False) if start > lo else ""
            text = tokenizer.decode(ids[lo:i + 1], skip_special_tokens=False)
            if text.endswith("\ufffd") and i + 1 < n:
                continue  # an unfinished character: wait for its next bytes
            if not text.startswith(prefix):
                return None
            spans.append((start, i + 1, text[len(prefix):]))
            start = i + 1
    except Exception:  # ids out of the vocabulary, a tokenizer that cannot decode them
        return None
    if "".join(s[2] for s in spans) != full:
        return None
    return spans


def shaded_pieces(tokenizer, ids: list[int], logprobs: list[float] | None) -> list[dict] | None:
    """Pieces for the template: text, shading bucket (least likely token of the piece), title."""
    spans = token_spans(tokenizer, ids)
    if spans is None:
        return None
    have_lp = isinstance(logprobs, list) and len(logprobs) == len(ids)
    pieces = []
    for a, b, text in spans:
        if have_lp:
            lps = [lp for lp in logprobs[a:b] if isinstance(lp, (int, float))]
            low = min(lps) if lps else None
            title = "; ".join(f"#{a + j} id {ids[a + j]}: p={math.exp(min(0.0, lp)):.3f} logprob={lp:.3f}"
                              for j, lp in enumerate(logprobs[a:b]) if isinstance(lp, (int, float)))
        else:
            low, title = None, f"#{a} id {ids[a]}"
        pieces.append({"text": text, "bucket": bucket(low), "title": title})
    return pieces


def logprob_summary(logprobs) -> dict | None:
    if not isinstance(logprobs, list) or not logprobs:
        return None
    vals = [float(x) for x in logprobs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not vals:
        return None
    return {
        "n": len(vals),
        "mean": sum(vals) / len(vals),
        "min": min(vals),
        "low": sum(1 for v in vals if v < math.log(0.5)),
        "very_low": sum(1 for v in vals if v < math.log(0.05)),
    }


def logprob_strip(logprobs, ids) -> list[dict]:
    """Without token strings: one cell per token, shaded, with id and logprob in its title."""
    if not isinstance(logprobs, list):
        return []
    ids = ids if isinstance(ids, list) and len(ids) == len(logprobs) else None
    cells = []
    for i, lp in enumerate(logprobs[:MAX_TOKENS_SHADED]):
        if not isinstance(lp, (int, float)):
            continue
        tid = f" id {ids[i]}" if ids else ""
        cells.append({"bucket": bucket(lp), "title": f"#{i}{tid}: p={math.exp(min(0.0, lp)):.3f} logprob={lp:.3f}"})
    return cells
