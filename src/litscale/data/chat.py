"""Conversations into tokens with a loss mask: a chat template renders the turns, and only the
assistant's tokens are trained on.

A row of ``data=sft`` is a conversation: a list of ``{"role", "content"}`` messages, or a prompt
and a response (one user turn, one assistant turn). A chat template (Jinja, as Hugging Face
stores it: ``tokenizer_config.json``'s ``chat_template``, or a ``chat_template.jinja`` beside it)
renders it to text; litscale's own template serves the shipped tokenizers (``bpe``, ``byte``),
which carry none.

Which text is the assistant's: for each assistant turn ``k``, the template renders the
conversation before it with the generation prompt (``add_generation_prompt=True``, what a
model is given at inference) as ``P_k``; the whole conversation must start with ``P_k``, and the
turn is the text from there to the end of its content, and the end-of-turn token where the
template writes one right after (``<|im_end|>``, ``<|eot_id|>``, the tokenizer's
``eos_token``). So what is trained on is what the model is to write after the generation
prompt, by every template that renders a conversation's beginning as the beginning of its
longer versions. Pieces are tokenized one by one, so a token never straddles a prompt and a
response.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from litscale.data.tokenizer import TextTokenizer, tokenizer_file

TrainOn = Literal["assistant", "last_assistant"]
ROLES = ("system", "user", "assistant")

# litscale's own template (the shipped tokenizers have none): each turn opens with its role in
# <|...|>; an assistant turn ends in the end-of-text token, which generation stops at.
BUILTIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it is rendered with; ``source``: where it
    came from, for messages and the cache key."""

    text: str
    source: str
    eos_token: str
    bos_token: str = ""

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        return _compiled(self.text).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           eos_token=self.eos_token, bos_token=self.bos_token)

    def knows_role(self, role: str) -> bool:
        """The template names the role (litscale's own: system, user, assistant)."""
        if self.text == BUILTIN_TEMPLATE:
            return role in ROLES

        def named(name: str) -> bool:
            return f"'{name}'" in self.text or f'"{name}"' in self.text

        # A template that names no role at all writes each message's role as it is (ChatML's
        # generic form): it knows every role.
        return named(role) or not any(named(name) for name in ROLES)


def load_chat_template(tokenizer: str, chat_template: str | None, eos_token: str) -> ChatTemplate:
    """The template ``data.chat_template`` names (a ``.jinja`` file, or ``builtin``), else the
    tokenizer directory's own, else litscale's built-in one. A one-line ``ValueError``."""
    if chat_template == "builtin":
        return ChatTemplate(BUILTIN_TEMPLATE, "builtin", eos_token)
    if chat_template is not None:
        path = Path(os.path.expanduser(chat_template))
        if not path.is_file():
            raise ValueError(f"data.chat_template={chat_template!r} is not a file; allowed: null (the tokenizer "
                             "directory's chat_template, else litscale's), builtin, or a .jinja file")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), eos_token)
    found = _tokenizer_template(tokenizer)
    if found is None:
        return ChatTemplate(BUILTIN_TEMPLATE, "builtin", eos_token)
    text, source, bos = found
    return ChatTemplate(text, source, eos_token, bos)


def _tokenizer_template(tokenizer: str) -> tuple[str, str, str] | None:
    """(template, its file, bos token) of a tokenizer directory, as transformers reads them: a
    ``chat_template.jinja`` file, or ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of named templates of which ``default`` is used)."""
    path = tokenizer_file(tokenizer)
    if path is None or tokenizer == "bpe":
        return None
    directory = path.parent
    config = _read_config(directory / "tokenizer_config.json")
    bos = config.get("bos_token") or ""
    bos = bos.get("content", "") if isinstance(bos, dict) else bos
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja), bos
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(template, str) and template:
        return template, str(directory / "tokenizer_config.json"), bos
    return None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"data.tokenizer: {path} is not JSON ({error})") from None
    return config if isinstance(config, dict) else {}


def _generation_blocks():
    """A Jinja extension that renders ``{% generation %}...{% endgeneration %}`` (the assistant
    blocks some templates mark for transformers' assistant masks) as its body: litscale finds
    the assistant's text by rendering prefixes, which works with or without them."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlocks


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
    """The template compiled in the sandbox transformers renders chat templates in (its
    ``chat_template_utils._compile_jinja_template``: trimmed blocks, loop controls,
    ``raise_exception``, ``tojson``). NOTE: written here, not imported: transformers is an
    optional extra, and ``data=sft`` with the shipped tokenizers needs none (jinja2 comes with torch)."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    generation_blocks = _generation_blocks()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, generation_blocks])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(text)


# --- rows -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """Where a row keeps its conversation: ``messages`` (a list of role/content), or a prompt
    and a response; ``format`` ``auto`` takes whichever the row has."""

    format: Literal["auto", "messages", "prompt_response"] = "auto"
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"


def conversation_of(record: object, fields: Fields, template: ChatTemplate, where: str) -> list[dict[str, str]]:
    """The row's messages, checked: a ``ValueError`` naming ``where`` (file and row) for a
    missing field, a role the template does not know, or an empty assistant turn."""
    if not isinstance(record, dict):
        raise ValueError(f"data.paths: {where} is not a JSON object")
    use_messages = fields.format == "messages" or (fields.format == "auto" and fields.messages in record)
    if use_messages:
        messages = record.get(fields.messages)
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"data.messages_field={fields.messages!r} is missing or not a list of messages in {where}")
    elif fields.prompt in record and fields.response in record:
        messages = [{"role": "user", "content": record[fields.prompt]},
                    {"role": "assistant", "content": record[fields.response]}]
    else:
        wanted = (f"{fields.messages!r} or {fields.prompt!r} and {fields.response!r}" if fields.format == "auto"
                  else f"{fields.prompt!r} and {fields.response!r}")
        raise ValueError(f"data.format={fields.format}: {where} has no {wanted} field; set data.messages_field or "
                         "data.prompt_field / data.response_field to the row's fields")
    checked = []
    for number, message in enumerate(messages, start=1):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"data.paths: message {number} of {where} is not a role and a text content")
        if not template.knows_role(role):
            raise ValueError(f"data.paths: message {number} of {where} has role {role!r}, which the chat template "
                             f"({template.source}) does not know; allowed: {', '.join(ROLES)}")
        if role == "assistant" and not content.strip():
            raise ValueError(f"data.paths: message {number} of {where} is an empty assistant turn")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError(f"data.paths: {where} has no assistant turn to train on")
    return checked


def assistant_spans(template: ChatTemplate, messages: list[dict[str, str]], train_on: TrainOn,
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans trained on): every assistant turn, or the
    last one only (module docstring)."""
    try:
        whole = template.render(messages)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last_assistant":
            turns = turns[-1:]
        spans = []
        for turn in turns:
            prompt = template.render(messages[:turn], add_generation_prompt=True)
            if not whole.startswith(prompt):
                raise ValueError(f"the chat template ({template.source}) does not render the conversation before "
                                 f"message {turn + 1} as the beginning of the whole conversation, so the assistant's "
                                 "tokens cannot be told apart; set data.chat_template to one that does")
            content = messages[turn]["content"]
            found = whole.find(content, len(prompt))
            if found < 0:
                raise ValueError(f"the chat template ({template.source}) does not write message {turn + 1}'s content "
                                 "as it is")
            end = found + len(content)
            if template.eos_token and whole.startswith(template.eos_token, end):
                end += len(template.eos_token)
            spans.append((len(prompt), end))
    except ValueError as error:
        raise ValueError(f"data.paths: {where}: {error}") from None
    except Exception as error:  # noqa: BLE001 - a template's own raise_exception, or a Jinja error
        raise ValueError(f"data.paths: {where}: the chat template ({template.source}) fails: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    return whole, spans


def tokens_with_mask(tokenizer: TextTokenizer, text: str, spans: list[tuple[int, int]],
                     eos_token: str) -> tuple[np.ndarray, np.ndarray]:
    """``text`` as token ids and, per token, whether it is trained on (inside ``spans``). Each
    piece between span edges is tokenized alone, and ``eos_token`` in the text is the
    tokenizer's end-of-text id whatever the tokenizer makes of its characters (bytes)."""
    edges = sorted({0, len(text), *(edge for span in spans for edge in span)})
    pieces = [(text[a:b], any(s <= a and b <= e for s, e in spans)) for a, b in zip(edges, edges[1:], strict=False)]
    ids, trained = [], []
    for piece, inside in pieces:
        for number, part in enumerate(piece.split(eos_token) if eos_token else [piece]):
            if number:
                ids.append(np.array([tokenizer.eos_id], dtype=np.int64))
                trained.append(np.full(1, inside))
            if part:
                encoded = np.asarray(tokenizer.encode_batch([part], add_special_tokens=False)[0], dtype=np.int64)
                ids.append(encoded)
                trained.append(np.full(len(encoded), inside))
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return np.concatenate(ids), np.concatenate(trained)


def prompt_tokens(tokenizer: TextTokenizer, template: ChatTemplate, messages: list[dict[str, str]]) -> np.ndarray:
    """What a model is given to answer ``messages`` (the generation prompt appended)."""
    text = template.render(messages, add_generation_prompt=True)
    return tokens_with_mask(tokenizer, text, [], template.eos_token)[0]
