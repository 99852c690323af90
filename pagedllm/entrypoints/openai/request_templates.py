"""A chat template sent in a request is a program the client runs on the server: a jinja loop of 20,000 x 20,000
holds a thread for minutes, `'x' * 300000000` takes a gigabyte. So, as vLLM (--trust-request-chat-template), a
request's template is refused unless the operator allows it, and an allowed one is rendered in a worker
process (isolated_worker.py) under a deadline, a memory cap and a limit on the text it makes; the server's own
template (--chat-template, or the tokenizer's) renders as before."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pagedllm.isolated_worker import (
    TEMPLATE_WORKER_MEMORY_BYTES,
    IsolatedWorker,
    WorkerCancelled,
    WorkerOutOfMemory,
    WorkerTimeout,
)

FLAG = "--trust-request-chat-template"


class RequestTemplateError(ValueError):
    """The request's chat template was refused or did not render within its limits (a 400)."""


@dataclass
class RequestTemplateRenderer:
    """render(template, messages, tools, add_generation_prompt) -> text, in the worker."""

    special_tokens: dict[str, str]
    timeout_s: float = 2.0
    memory_bytes: int = TEMPLATE_WORKER_MEMORY_BYTES
    max_chars: int = 1 << 20  # the rendered text (the prompt must still fit max_model_len after)
    _worker: IsolatedWorker | None = field(default=None, init=False, repr=False)

    def render(self, template: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
               template_kwargs: dict | None = None, cancel: threading.Event | None = None) -> str:
        if self._worker is None:
            self._worker = IsolatedWorker(f"{__name__}:template_worker", self.special_tokens, self.memory_bytes)
        try:
            return self._worker.call((template, messages, tools, add_generation_prompt, self.max_chars,
                                      template_kwargs or {}),
                                     self.timeout_s, cancel)
        except WorkerTimeout:
            raise RequestTemplateError(f"the request's chat_template did not render within {self.timeout_s:g} s, "
                                       f"this server's limit (--request-chat-template-timeout).") from None
        except WorkerOutOfMemory:
            raise RequestTemplateError(f"the request's chat_template needed more than "
                                       f"{self.memory_bytes / 2**30:g} GiB to render, this server's limit.") from None
        except WorkerCancelled:
            raise
        except ValueError as e:
            raise RequestTemplateError(f"the request's chat_template failed on these messages: {e}") from None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def template_worker(special_tokens: dict[str, str]):
    """The isolated worker's handler: (template, messages, tools, add_generation_prompt, max_chars,
    template_kwargs) -> text,
    rendered as transformers' apply_chat_template renders (its sandboxed jinja environment and globals)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(request) -> str:
        template, messages, tools, add_generation_prompt, max_chars, template_kwargs = request
        try:
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                                add_generation_prompt=add_generation_prompt,
                                                **{**template_kwargs, **special_tokens})
        except MemoryError:
            raise
        except Exception as e:  # jinja's errors (syntax, undefined, raise_exception) with their reason
            raise ValueError(str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__) from None
        text = rendered[0]
        if len(text) > max_chars:
            raise ValueError(f"it rendered {len(text)} characters, more than this server's limit of {max_chars}")
        return text

    return render
