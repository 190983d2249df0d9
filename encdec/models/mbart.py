"""mBART (mbart-large-cc25, mbart-large-en-ro) and mBART-50 on the BART layout:
pre-norm blocks, ``layernorm_embedding``, closing layer norms on both stacks,
learned positions offset by 2, ``final_logits_bias``.

Language tokens, as mBART places them (the tokenizers write the encoder side):

    checkpoint       encoder input            decoder prompt (HF's start)
    cc25 / en-ro     text </s> <src_lang>     [<tgt_lang>]  (decoder_start_token_id)
    mBART-50         <src_lang> text </s>     [</s>, <tgt_lang>]  (forced_bos_token_id)

Both are the default decoder prompt where the checkpoint's configs say so
(``start_then_forced_bos``); otherwise give the target language explicitly.
"""
from __future__ import annotations

from encdec.models.bart import BartForConditionalGeneration, Layout, start_then_forced_bos


class MBartForConditionalGeneration(BartForConditionalGeneration):
    layout = Layout(pre_norm=True, stack_layer_norm=True)
    model_name = "mBART"


default_decoder_prompt = start_then_forced_bos
