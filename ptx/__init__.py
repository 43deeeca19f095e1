"""Inline-PTX building blocks (CUDA headers), shipped as package data for the run-time compiler."""
