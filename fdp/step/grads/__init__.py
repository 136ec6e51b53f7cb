"""A device's gradient: batch and loss contracts, keys, per-use gathers, scanned stacks, guards."""
