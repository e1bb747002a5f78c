// Package pglock grants lease locks with fencing tokens on PostgreSQL.
package pglock
