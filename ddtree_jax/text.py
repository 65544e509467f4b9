"""Text in and out: the HF tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.sandbox

from ddtree_jax.config import read_json
from ddtree_jax.errors import DDTreeError


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


class TextCodec:
    """Encodes prompts (plain text or chat messages) to ids and decodes generated ids to text."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise DDTreeError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = directory / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.template = None
        source = cfg.get("chat_template")
        if isinstance(source, list):  # several named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            try:
                self.template = env.from_string(source)
            except jinja2.TemplateError as e:
                raise DDTreeError(f"{cfg_path}: chat_template does not parse ({e})") from None

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied to `messages`, with the generation prompt appended."""
        if self.template is None:
            raise DDTreeError("the target has no chat template; use --no-chat-template or 'input_ids'")
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise DDTreeError(f"the chat template refused the messages ({e})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def without_special(self, text: str) -> str:
        """`text` with every special token's text (stop tokens, chat markers) taken out."""
        for token in self.tokenizer.get_added_tokens_decoder().values():
            if token.special:
                text = text.replace(token.content, "")
        return text

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens kept, so stop tokens stay visible)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)
