"""Draft heads: small layers over the target's own hidden states that propose its next tokens.

    base.py         the `DraftHead` protocol (what a head offers the drafter that runs it) and the
                    toolkit every head shares: HeadShape, HeadKV, head_rope, head_linear, the
                    LayerHead / FinalHiddenHead bases, measure_step_cost
    eagle3.py       EAGLE-3 heads (fused aux layers, reduced draft vocabulary)
    eagle3_gguf.py  EAGLE-3 heads in llama.cpp's GGUF layout
    eagle1.py       EAGLE-1/2 heads (over the final hidden state)
    mtp.py          a checkpoint's own multi-token-prediction layers (MiMo)
    medusa.py       Medusa heads (parallel heads over the final hidden state)
    loader.py       one loader for the EAGLE layouts, which it sniffs
    shipped.py      the heads shipped as package data, in the folders beside these modules

The drafters that run them are `tokenleap.drafters.head_drafter` (any `DraftHead`, chains or
EAGLE-2 trees; and Medusa's) and their method records `tokenleap.drafters.head_methods`; the
trainable heads of `tokenleap.train` are built on the same `HeadShape` and `head_rope`. The heads
import nothing of the drafters: kernels < models < heads < drafters < engine.
"""
