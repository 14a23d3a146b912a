"""DSpark / DFlash / Eagle3 speculative decoding for stock `transformers` (no hf_dspark install needed).

    target.generate(input_ids, assistant_model=drafter, custom_generate=<this repo>, trust_remote_code=True)

`drafter` is the drafter of this repository, loaded with `AutoModel.from_pretrained(repo, trust_remote_code=True)`.
The files beside this one are copies of hf_dspark 0.1.0's decoding loop; the lossless verification rule is in
`verification.py`.
"""

import functools

from .decoding import speculative_decoding


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            streamer=None, drafter=None, **model_kwargs):
    return speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                drafter=drafter, streamer=streamer, **model_kwargs)


def generate(model, *args, assistant_model=None, **kwargs):
    if assistant_model is None:
        raise ValueError(
            "This custom_generate runs speculative decoding: pass the drafter as assistant_model=, loaded with "
            "AutoModel.from_pretrained(<repo>, trust_remote_code=True)."
        )
    if getattr(getattr(assistant_model, "config", None), "model_type", None) not in ['dspark', 'eagle3_draft']:
        raise ValueError(
            f"assistant_model is a {type(assistant_model).__name__}, not an hf_dspark drafter "
            "(config.model_type must be one of ['dspark', 'eagle3_draft'])."
        )
    # generate() hands a callable custom_generate everything it prepared (processors, stopping criteria, cache);
    # the drafter and the streamer travel bound to it because generate() drops both for callables.
    decode = functools.partial(_decode, drafter=assistant_model, streamer=kwargs.get("streamer"))
    return model.generate(*args, assistant_model=assistant_model, custom_generate=decode, **kwargs)
