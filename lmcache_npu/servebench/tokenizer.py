"""A word-level tokenizer for the replay's models, made here: token id i is the word "t<i>", so any list of ids
decodes to text that encodes back to exactly those ids. vLLM's `bench serve` datasets and its OpenAI server need a
tokenizer; the replay's models are made from a config and have none."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".word-tokenizer-{vocab}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # another process may have made it meanwhile: theirs is identical
    except OSError:
        if not (target / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("made a %d-word tokenizer in %s", vocab, target)
    return target
