package fencedwrite

// ValueError exports valueError to the tests of package fencedwrite_test.
var ValueError = valueError
