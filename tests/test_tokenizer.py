"""`ChatTokenizer` (gsm8kctl/artifacts/tokenizer.py) against transformers' tokenizer on the same files.

The prompt ids a sampler sees are the training data's, token for token, so the light tokenizer
must render and encode exactly as `AutoTokenizer` does.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gsm8kctl.artifacts.chat import render_completion
from gsm8kctl.artifacts.data import load_problems
from gsm8kctl.artifacts.models import load_chat_tokenizer, load_tokenizer, stop_token_ids
from gsm8kctl.artifacts.tokenizer import ChatTokenizer
from gsm8kctl.config import load_config
from gsm8kctl.sampling.attempts import prompt_for


@pytest.mark.parametrize("few_shot", [0, 4])
def test_gsm8k_prompts_and_answers_match_transformers(smollm2_dir, few_shot):
    light, hf = load_chat_tokenizer(smollm2_dir), load_tokenizer(smollm2_dir)
    assert isinstance(light, ChatTokenizer)
    cfg = load_config(None, [f"agent.few_shot={few_shot}"])
    pool = load_problems("train", cfg["data_dir"])
    problems = load_problems("test", cfg["data_dir"])[:150]
    for p in problems:
        assert prompt_for(cfg, light, p, pool) == prompt_for(cfg, hf, p, pool)
    for p in pool[:150]:
        ids = render_completion(light, p["solution"])
        assert ids == render_completion(hf, p["solution"])
        assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
        assert light.decode(ids) == hf.decode(ids)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        assert getattr(light, name) == getattr(hf, name)
    assert stop_token_ids(light) == stop_token_ids(hf)
    assert light.convert_tokens_to_ids("no-such-token-here") == hf.convert_tokens_to_ids("no-such-token-here")
    assert len(light) == len(hf)


def test_template_from_tokenizer_config_with_its_jinja_extras(smollm2_dir, tmp_path):
    """A template kept in tokenizer_config.json, using what transformers' environment offers:
    `raise_exception`, a `tojson` that keeps '<', the special tokens as variables, a
    `{% generation %}` block, loop controls."""
    path = tmp_path / "tok"
    shutil.copytree(smollm2_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "chat_template.jinja").unlink()
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
                "{{ bos_token }}{{ m['role'] }} {{ m['content'] | tojson }}\n"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endif %}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    light, hf = load_chat_tokenizer(str(path)), load_tokenizer(str(path))
    assert isinstance(light, ChatTokenizer)
    messages = [{"role": "user", "content": "x < 3 & \"y\""}, {"role": "skip", "content": "-"},
                {"role": "assistant", "content": "<b>4</b>"}]
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert light.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want
        assert '"x < 3 & \\"y\\""' in want
    with pytest.raises(Exception, match="no tools"):
        light.apply_chat_template([{"role": "tool", "content": ""}])


def test_without_a_template_it_is_transformers_tokenizer(smollm2_dir, tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(smollm2_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    assert not isinstance(load_chat_tokenizer(str(path)), ChatTokenizer)
