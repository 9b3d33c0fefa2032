"""Helpers of the validation ladder's tests (tests/test_ladder_*.py): model files, engines, the
reference decoder block."""
