"""Real models bring their own chat template: token-level episodes append exactly what the
template renders.  The tokenizer here is a real HF fast tokenizer (character level, ChatML
template with a tool role), saved and loaded through ``load_tokenizer(dir)``.
"""
import string

import pytest

from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.models.tokenizer import HFTokenizer, load_tokenizer
from neon_hpc.rollout.agent import run_episode
from neon_hpc.rollout.agent.template import HFChatTemplate, TemplateError, make_template
from test_agent_episode import Result, ToyEnv

CHATML = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
          "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    vocab = {c: i for i, c in enumerate(specials + sorted(set(string.printable)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"])
    fast.chat_template = CHATML
    d = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(d)
    return load_tokenizer(str(d))


class HFScripted:
    def __init__(self, tok, script):
        self.tok, self.script, self.prompts = tok, list(script), []

    def generate(self, input_ids, sampling_params, **kw):
        self.prompts.append(list(input_ids))
        out = self.tok.encode(self.script.pop(0))
        return Result(out, [-0.2] * len(out), None, "0")


def test_episode_appends_exactly_what_the_template_renders(hf_tok):
    assert isinstance(hf_tok, HFTokenizer) and isinstance(make_template(hf_tok), HFChatTemplate)
    im_end = "<|im_end|>"
    script = [f"<tool_call>lookup</tool_call>{im_end}", f"<answer>42</answer>{im_end}"]
    cfg = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_tokens=4096)
    traj = run_episode(HFScripted(hf_tok, script), ToyEnv(), hf_tok, cfg, replay="off")
    assert traj.reward == 1.0 and traj.metadata["tool_calls"] == 1
    env = ToyEnv()
    messages = [{"role": "system", "content": env.system_text()}, {"role": "user", "content": env.task_text()},
                {"role": "assistant", "content": "<tool_call>lookup</tool_call>"},
                {"role": "tool", "content": env.format_result({"number": 42})},
                {"role": "assistant", "content": "<answer>42</answer>"}]
    rendered = hf_tok.hf.apply_chat_template(messages, tokenize=False)
    assert hf_tok.decode(traj.tokens.tolist()) == rendered.rstrip("\n")
    assert traj.tokens.tolist() == hf_tok.encode(rendered.rstrip("\n"))
    assert hf_tok.decode(traj.tokens[traj.loss_mask == 1].tolist()) == "".join(script)


def test_templates_that_rewrite_history_are_refused(hf_tok):
    hf_tok.hf.chat_template = "{% for m in messages[-1:] %}{{ m.content }}{% endfor %}"
    try:
        tpl = HFChatTemplate(hf_tok)
        tpl.opening("s", "u")
        with pytest.raises(TemplateError, match="rewrites earlier turns"):
            tpl.after_output("user", "x")
    finally:
        hf_tok.hf.chat_template = CHATML
