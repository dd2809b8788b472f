"""Pieces every model family is built from: attention (grouped-query and latent), the
MoE feed-forward and its routing, the recurrent mixers (Mamba2, gated DeltaNet), rotary
tables and windowed attention."""
