//go:build !pgfence_skiplocked

package main

// pgfenceB4Variants returns nothing until skiplocked is merged.
func (b *bench) pgfenceB4Variants(int) []variant { return nil }
