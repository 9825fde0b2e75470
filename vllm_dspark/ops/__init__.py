"""Pure math shared by the vLLM model, the reference drafter, the drift harness and the tests."""
