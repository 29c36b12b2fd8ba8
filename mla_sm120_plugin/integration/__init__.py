"""Engine integrations, one subpackage an engine, each with the same rooms: :mod:`.vllm` (vLLM 0.33 and 0.34,
the ``vllm.general_plugins`` entry point) and :mod:`.sglang` (SGLang 0.5.23, ``sglang.srt.plugins``);
:mod:`.catalogue` is what an entry of each one's internals catalogue says."""
