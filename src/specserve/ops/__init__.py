"""Operator tools: formulas, audits and planning aids (specserve calc / audit)."""
