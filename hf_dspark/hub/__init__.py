"""Sharing drafters: model cards, Hub upload, folders stock transformers can run, DeepSpec conversion.

Importing this package (`import hf_dspark` does) installs the hooks through which a drafter's `save_pretrained`
writes `custom_generate/` and its `push_to_hub` uploads with a card: the models layer below never imports the hub.
"""

from ..models.hub_hooks import install_hub_hooks


def _save_extras(folder):
    from .remote_code import write_custom_generate

    return write_custom_generate(folder)


def _push(drafter, repo_id, **options):
    from .push import push_drafter

    return push_drafter(drafter, repo_id, **options)


install_hub_hooks(save_extras=_save_extras, push=_push)
