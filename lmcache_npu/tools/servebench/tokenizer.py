"""A word-level tokenizer for the replay's models, made here: token id i is the word "t<i>", so any list of ids
decodes to text that encodes back to exactly those ids. vLLM's `bench serve` datasets and its OpenAI server need a
tokenizer; the replay's models are made from a config and have none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..replay.staging import publish_directory

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0-3; the workloads' ids start above them


def tokenizer_dir(vocab: int, cache_dir: Optional[Path] = None) -> Path:
    """The directory of a `vocab`-word tokenizer (tokenizer.json + tokenizer_config.json), made on first use."""
    if vocab <= len(SPECIAL_TOKENS):
        raise ValueError(f"a tokenizer vocabulary must exceed its {len(SPECIAL_TOKENS)} special tokens, got {vocab}")
    from ..replay.models import default_cache_dir

    target = (cache_dir or default_cache_dir()) / f"word-tokenizer-{vocab}"
    if (target / "tokenizer.json").exists():
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space, nothing else
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    publish_directory(target, tokenizer.save_pretrained, "tokenizer.json")
    logger.info("made a %d-word tokenizer in %s", vocab, target)
    return target
