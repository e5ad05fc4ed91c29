"""The tokenizer stage: chat rendering, tokenization and prompt checks, one request at a time."""

from __future__ import annotations

import logging
from typing import Optional, Union

import msgspec

from ..errors import InvalidRequestError, PocketLLMError, PromptTooLongError
from ..model_info import ModelInfo
from ..proto.messages import (ErrorKind, GenerateRequest, RequestError, StructuredSpec,
                              TokenizedRequest)
from ..protocol.chat import ChatRenderer
from ..protocol.tool_choice import take_tool_options, tool_split
from ..protocol.tool_parsers import get_tool_parser, parser_for_template
from ..protocol.tool_prompt import FORCED_SYNTAX, template_shows_tools, with_tools_in_text
from ..sampling import check_token_ids_in_vocab
from .reasoning import reasoning_split
from .tokenizer import load_tokenizer

log = logging.getLogger("pocketllm.tokenizer")


class TokenizerStage:
    def __init__(self, info: ModelInfo, tool_call_parser: Optional[str] = None):
        self.info = info
        self.loaded = load_tokenizer(info)
        self.tokenizer = self.loaded.tokenizer
        self.chat = ChatRenderer(info.chat_template, info.family, self.loaded.special_tokens)
        # The built-in template's turn terminator ends a chat answer like an EOS would.
        self.chat_stop_ids = [i for i in [self.loaded.token_id(self.chat.stop_token)]
                              if i is not None]
        # The call syntax the checkpoint's template teaches, or the one --tool-call-parser
        # names (None: "auto" is refused; forced calls use FORCED_SYNTAX).
        self.tool_parser = (get_tool_parser(tool_call_parser) if tool_call_parser else
                            parser_for_template(info.chat_template, info.family))
        # A template without a `tools` variable gets them in a system message (tool_prompt).
        self.tools_in_text = self.chat.available and not template_shows_tools(
            self.chat.template_source)

    def handle(self, req: GenerateRequest) -> Union[TokenizedRequest, RequestError]:
        """The request's next message; nothing one request holds can raise out of here."""
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
        """Refuse a grammar that cannot compile before it is scheduled (no vocabulary needed;
        imports xgrammar on the first structured request)."""
        if self.loaded.placeholder:
            raise InvalidRequestError(
                "structured output needs the checkpoint's vocabulary, and this one has none "
                "(dummy weights from a bare config.json); pass a tokenizer", spec.param)
        from ..scheduler.grammar import check_spec

        try:
            check_spec(spec)
        except ValueError as e:
            raise InvalidRequestError(str(e), spec.param) from None

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
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
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
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True).ids
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise PromptTooLongError(
                f"the prompt is {len(ids)} tokens; this engine's max_model_len is {limit}, which "
                "must also leave room for at least one generated token", "prompt")
        room = limit - len(ids)
        max_tokens = room if sampling.max_tokens == 0 else sampling.max_tokens
        if max_tokens > room:
            max_tokens = room  # ends with finish_reason "length" at max_model_len
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
                                arrival_time=req.arrival_time, split=split, echo_text=echo_text)
