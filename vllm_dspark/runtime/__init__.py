# SPDX-License-Identifier: Apache-2.0
"""The plugin runtime vLLM loads: the drafter model class, its attention and the CPU W8A16 kernel."""
