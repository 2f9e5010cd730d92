"""overmind_jupyter"""
