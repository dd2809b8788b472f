"""A tiny Llama that thinks and calls tools, saved as a Hugging Face folder with transformers.

Its tokenizer is SmolLM2's plus four added tokens, `<think>`, `</think>`, `<tool_call>` and
`</tool_call>`; its chat template (Qwen style) renders tools and opens a think block in the
generation prompt. The weights are random but for a scripted bigram chain: every layer's
output projections are zero, so the logits depend on the last token alone, and the LM head
makes each token of SCRIPT the clear favourite after its predecessor. Greedy decoding
therefore answers every chat with

    <think>\\n | Let me see | </think> | Paris is lovely. | <|im_end|>
    (prompt)    reasoning                content

while sampling at temperature 1 strays from the chain (the favourite holds a few percent
of the mass), which is what the adaptive-sampling tests need.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from spillway.shared.config import DEFAULT_MODEL, Settings
from spillway.shared.model_files import resolve_model
from spillway.shared.tokenizer_files import cache_folder, load_tokenizer
from tests.tiny_llama_config import tiny_llama_config

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
THINK_END_ID = 49153  # the added tokens follow SmolLM2's 49152
REASONING = " Let me see"
CONTENT = " Paris is lovely."
EOS_ID = 2  # <|im_end|>
# How far the scripted token stands above the rest (in logits, before the final norm's
# scale of sqrt(hidden) = 8): 8 * 1.1 ~ 9 nats, a few percent of the mass at temperature 1.
SCRIPT_STRENGTH = 1.1

CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


def script_ids(tokenizer) -> list[int]:
    """The chain, from the generation prompt's last token ("\\n") to EOS (`tokenizer`:
    transformers' or the gateway's, anything with encode(text, add_special_tokens))."""
    (think_end,) = tokenizer.encode("</think>", add_special_tokens=False)
    reasoning = tokenizer.encode(REASONING, add_special_tokens=False)
    content = tokenizer.encode(CONTENT, add_special_tokens=False)
    chain = [tokenizer.encode("\n", add_special_tokens=False)[0], *reasoning, think_end]
    return [*chain, *content, EOS_ID]


def save_think_llama(folder: Path) -> Path:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    source = resolve_model(DEFAULT_MODEL)
    load_tokenizer(source, Settings().cache_dir)  # converts the GGUF's tokenizer once
    base = cache_folder(source, Settings().cache_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base))
    tokenizer.add_tokens(MARKERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("</think>") == THINK_END_ID
    chain = script_ids(tokenizer)
    assert len(set(chain[:-1])) == len(chain) - 1, "a bigram chain needs distinct tokens"
    config = tiny_llama_config(len(tokenizer), 4096, eos_token_id=EOS_ID)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, H]
        embed.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight  # [V, H]
        head.normal_(0.0, 0.02)
        for token, following in itertools.pairwise(chain):
            head[following] += SCRIPT_STRENGTH * embed[token] / embed[token].norm()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
