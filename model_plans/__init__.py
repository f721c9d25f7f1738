"""Declarative tensor-parallel plans per architecture (see the tensor-parallel issue)."""
