# SPDX-License-Identifier: Apache-2.0
"""Tools that write drafter checkpoints: the quantizer and random drafters in the real layout."""
