"""The text layer: tokenizer, chat template, streaming detokenizer, stops, generation defaults.

Everything here reads the model's text files only through `Artifact.read_text`, so it works
the same for a Hugging Face folder and a `.ninfer` container.
"""

from ninfer_core.text.chat_template import ChatTemplate, ChatTemplateError
from ninfer_core.text.detokenizer import IncrementalDetokenizer
from ninfer_core.text.generation_config import GenerationDefaults, stop_token_ids
from ninfer_core.text.stops import StopChecker, StopUpdate
from ninfer_core.text.tokenizer import SpecialTokens, Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "GenerationDefaults",
    "IncrementalDetokenizer",
    "SpecialTokens",
    "StopChecker",
    "StopUpdate",
    "Tokenizer",
    "stop_token_ids",
]
