"""Evaluation harness: question loaders, runs, judgements and reports."""
