"""Speculative decoding: proposers guess a request's next tokens, the target model checks them all in one
forward (`verify`), and a rule decides each step whether guessing pays (`policy`)."""
