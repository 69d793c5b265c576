"""The tokenizer of a run written beside its exported Hugging Face directory, as transformers
reads one: ``tokenizer.json`` and a ``tokenizer_config.json`` naming its end-of-text token and,
for a fine-tune, the chat template it was trained with. So the exported directory alone is
what ``AutoTokenizer.from_pretrained`` and ``apply_chat_template`` need, and what
``python -m litscale.app.generate`` prompts the model with.

Who calls it: ``litscale.checkpoint.export.export_model`` (rank 0, ``export_hf=true``), through the data
module's ``save_tokenizer``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from litscale.data.chat import ChatTemplate
from litscale.data.tokenizer import TextTokenizer, tokenizer_file


def write_tokenizer_directory(tokenizer: TextTokenizer, template: ChatTemplate | None, directory: str) -> list[str]:
    """Write ``tokenizer`` (and ``template``) into ``directory``; return the files written.
    A byte-level tokenizer has no ``tokenizer.json``: nothing is written for it."""
    source = tokenizer_file(tokenizer.name) if hasattr(tokenizer, "name") else None
    if source is None:
        return []
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target / "tokenizer.json")
    # A tokenizer directory's own settings (special tokens, its class) stay; the shipped BPE has none.
    settings = source.with_name("tokenizer_config.json")
    own = tokenizer.name != "bpe" and settings.is_file()
    config = json.loads(settings.read_text(encoding="utf-8")) if own else {"tokenizer_class": "PreTrainedTokenizerFast"}
    config["eos_token"] = tokenizer.eos_token
    # A causal LM takes no token type ids, which a generic fast tokenizer returns unless told:
    # generate() refuses inputs the model does not use.
    config.setdefault("model_input_names", ["input_ids", "attention_mask"])
    if template is not None:
        config["chat_template"] = template.text
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [str(target / "tokenizer.json"), str(target / "tokenizer_config.json")]
