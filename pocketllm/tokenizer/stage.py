"""The tokenizer stage: chat rendering, tokenization and prompt checks.

``prepare`` is safe to run on several threads at once (loop.py runs a small pool);
the grammar check of a structured request is separate (grammar_checks.py), so the
loop can wait for it without holding a thread.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import msgspec

from ..errors import InvalidRequestError, PocketLLMError, PromptTooLongError
from ..model_info import ModelInfo
from ..proto.messages import (DetokRequest, ErrorKind, GenerateRequest, RequestError,
                              StructuredSpec, TokenizedRequest)
from ..protocol.chat import ChatRenderer
from ..protocol.reasoning import reasoning_split
from ..protocol.tool_choice import take_tool_options, tool_split
from ..protocol.tool_parsers import get_tool_parser, parser_for_template
from ..protocol.tool_prompt import FORCED_SYNTAX, template_shows_tools, with_tools_in_text
from ..sampling import check_token_ids_in_vocab
from .grammar_checks import GrammarChecks
from .tokenizer import load_tokenizer

log = logging.getLogger("pocketllm.tokenizer")


class TokenizerStage:
    def __init__(self, info: ModelInfo, tool_call_parser: Optional[str] = None,
                 max_output_tokens: Optional[int] = None,
                 structured_output_timeout_s: float = 10.0):
        self.info = info
        self.loaded = load_tokenizer(info)
        self.tokenizer = self.loaded.tokenizer
        # The largest max_tokens a request may ask (EngineArgs.max_output_tokens).
        self.max_output_tokens = max_output_tokens or info.max_model_len
        # A text longer than this cannot fit max_model_len whatever it tokenizes to, so it
        # is refused before the tokenizer spends seconds on it.
        self.max_prompt_chars = info.max_model_len * max_chars_per_token(
            self.tokenizer, self.loaded.longest_token)
        self.grammar_checks = GrammarChecks(structured_output_timeout_s)
        self.chat = ChatRenderer(info.chat_template, info.family, self.loaded.special_tokens)
        # The built-in template's turn terminator ends a chat answer like an EOS would.
        self.chat_stop_ids = [i for i in [self.loaded.token_id(self.chat.stop_token)]
                              if i is not None]
        # The call syntax the template (the checkpoint's or the built-in one) teaches, or the
        # one --tool-call-parser names (None: "auto" is refused; forced calls use FORCED_SYNTAX).
        self.tool_parser = (get_tool_parser(tool_call_parser) if tool_call_parser else
                            parser_for_template(self.chat.template_source))
        # A template without a `tools` variable gets them in a system message (tool_prompt).
        self.tools_in_text = self.chat.available and not template_shows_tools(
            self.chat.template_source)

    def handle(self, req: GenerateRequest) -> Union[TokenizedRequest, RequestError]:
        """``prepare`` and the grammar check, on the caller's thread (waits for the check
        up to its time limit)."""
        out = self.prepare(req)
        if isinstance(out, TokenizedRequest) and out.sampling.structured is not None:
            answer = self.grammar_checks.answer(out.sampling.structured)
            if answer is not None:
                return RequestError(req.request_id, answer[1], kind=ErrorKind(answer[0]),
                                    param=out.sampling.structured.param)
        return out

    def prepare(self, req: GenerateRequest) -> Union[TokenizedRequest, RequestError]:
        """Everything but the grammar's compilability (the caller checks that)."""
        try:
            return self._tokenize(req)
        except PocketLLMError as e:
            return RequestError(req.request_id, str(e), kind=e.kind, param=e.param)
        except Exception as e:  # noqa: BLE001 - a bug met by one request fails only that one
            log.exception("request %s failed in the tokenizer", req.request_id)
            return RequestError(req.request_id, f"the tokenizer failed on this request: "
                                f"{type(e).__name__}: {e}", kind=ErrorKind.internal)

    def _render(self, messages: list, opts: dict, add_gen: bool) -> str:
        """The chat template's text. The template runs over the caller's messages and
        chat_template_kwargs, so whatever it raises is the input's fault (a 400)."""
        try:
            return self.chat.render(messages, add_generation_prompt=add_gen, **opts)
        except PocketLLMError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a kwarg that overrides a template variable
            param = "chat_template_kwargs" if isinstance(e, TypeError) and opts else "messages"
            raise InvalidRequestError(f"the chat template could not render this request: "
                                      f"{type(e).__name__}: {e}", param) from None

    def _check_structured(self, spec: StructuredSpec) -> None:
        if self.loaded.placeholder:
            raise InvalidRequestError(
                "structured output needs the checkpoint's vocabulary, and this one has none "
                "(dummy weights from a bare config.json); pass a tokenizer", spec.param)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the prompt is {len(text)} characters, and no token of this vocabulary "
                f"stands for more than {self.max_prompt_chars // self.info.max_model_len}: it "
                f"is longer than this engine's max_model_len of {self.info.max_model_len} "
                "tokens whatever it tokenizes to", "prompt")
        # encode_batch releases the GIL (encode does not): other requests keep moving
        # while a long prompt is tokenized on another thread.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        sampling = req.sampling
        if self.loaded.placeholder and (req.prompt is not None or req.messages is not None):
            raise InvalidRequestError(
                "this checkpoint has no tokenizer (dummy weights from a bare config.json): "
                "send prompts as token ids, or pass a tokenizer", "prompt")
        if self.loaded.placeholder and sampling.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this checkpoint has none",
                                      "stop")
        split = None
        if req.messages is not None:
            opts = dict(req.chat_options)
            add_gen = opts.pop("add_generation_prompt", True)
            drop_thinking = bool(opts.pop("drop_thinking", False))  # ours, not the template's
            tool_req = take_tool_options(opts)  # tool_choice etc. are ours too
            parser = self.tool_parser
            if parser is None and tool_req.tools and tool_req.choice != "auto":
                parser = get_tool_parser(FORCED_SYNTAX)  # the grammar makes the model write it
            messages = req.messages
            if self.tools_in_text:
                opts.pop("tools", None)
                messages = with_tools_in_text(
                    messages, parser.name if parser else FORCED_SYNTAX, tool_req.tools,
                    tool_req.choice, tool_req.parallel)
            text = self._render(messages, opts, add_gen)
            # The template already wrote any BOS it wants.
            ids = self._encode(text, add_special_tokens=False)
            split = reasoning_split(self.chat.template_source, self.loaded, ids, drop_thinking)
            split, sampling = tool_split(tool_req, parser, split, sampling)
            if self.chat_stop_ids:
                sampling = msgspec.structs.replace(
                    sampling, stop_token_ids=sorted(set(sampling.stop_token_ids)
                                                    | set(self.chat_stop_ids)))
        elif req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary (0..{self.info.vocab_size - 1})",
                    "prompt")
        else:
            if not req.prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            ids = self._encode(req.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise PromptTooLongError(
                f"the prompt is {len(ids)} tokens; this engine's max_model_len is {limit}, which "
                "must also leave room for at least one generated token", "prompt")
        if sampling.max_tokens > self.max_output_tokens:  # OpenAI's rule: refused, not cut
            raise InvalidRequestError(
                f"max_tokens is too large: {sampling.max_tokens}; this server generates at most "
                f"{self.max_output_tokens} tokens per choice", "max_tokens")
        room = min(limit - len(ids), self.max_output_tokens)
        # 0 (not given): the room; past the room, the answer ends with "length" at max_model_len
        max_tokens = min(sampling.max_tokens or room, room)
        sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
        check_token_ids_in_vocab(sampling, self.info.vocab_size)
        if sampling.structured is not None:
            self._check_structured(sampling.structured)
        echo_text = ""
        if req.echo:  # the prompt as sent; token ids as the detokenizer would show them
            echo_text = req.prompt if req.prompt is not None else self.tokenizer.decode(
                ids, skip_special_tokens=sampling.skip_special_tokens)
        return TokenizedRequest(req.request_id, ids, sampling,
                                eos_token_ids=list(self.info.eos_token_ids),
                                arrival_time=req.arrival_time, client=req.client,
                                detok=DetokRequest(req.request_id, len(ids), sampling, split,
                                                   echo_text))


def max_chars_per_token(tokenizer, longest: Optional[int] = None) -> int:
    """The most characters of text one token can stand for: its longest vocabulary entry,
    times 4 when a normalizer may compose characters first (NFC/NFKC can fold up to three
    into one); replacing spaces with a marker, as SentencePiece vocabularies do, keeps the
    count. ``longest``: the longest entry, when the caller knows it."""
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    norm = repr(tokenizer.normalizer)
    composes = any(form in norm for form in ("NFC", "NFKC", "Precompiled"))
    return max(1, longest) * (4 if composes else 1)
