"""Evaluation: perplexity (lm-eval tasks and speed come in later modules)."""

from blockfold.eval.perplexity import perplexity, read_eval_text, tokenize_windows

__all__ = ["perplexity", "read_eval_text", "tokenize_windows"]
