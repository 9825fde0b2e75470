"""Command-line tools: the ``vllm-dspark`` entry point and the commands that live outside vLLM."""
