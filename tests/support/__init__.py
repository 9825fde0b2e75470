# SPDX-License-Identifier: Apache-2.0
"""What several test modules share: checkpoint editing, the encodings table, vLLM-built drafters, the e2e run."""
