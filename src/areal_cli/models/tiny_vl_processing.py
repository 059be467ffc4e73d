"""The images-only processors of the tiny VLMs (Qwen2.5-VL's and Qwen2-VL's), as a standalone file.

:func:`areal_cli.models.tiny_vl.make_tiny_vl_model` copies this file into the model dir as
``processing_tiny_vl.py`` and names its family's class in ``processor_config.json``'s ``auto_map``, so a
loader that trusts the dir's code (``AutoProcessor.from_pretrained(dir, trust_remote_code=True)``; vLLM with
``--trust-remote-code``) gets a processor without torchvision. Without that flag transformers keeps the
stock processor (``processor_class``), which needs torchvision for its video processor.
It imports nothing but transformers: it runs inside other interpreters (vLLM's venv) that lack areal_cli.
"""

from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor


def _images_only(base):
    class ImagesOnly(base):
        """The processor with no video processor: ``ProcessorMixin`` type-checks every sub-processor against
        ``VideoProcessorMixin``, which transformers does not export without torchvision."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"ImagesOnly{base.__name__}"
    return ImagesOnly


ImagesOnlyQwen2_5_VLProcessor = _images_only(Qwen2_5_VLProcessor)
ImagesOnlyQwen2VLProcessor = _images_only(Qwen2VLProcessor)
