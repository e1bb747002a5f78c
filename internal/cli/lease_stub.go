//go:build !pglockapi

package cli

import "github.com/spf13/cobra"

func (a *app) addLeaseCommands(*cobra.Command) {}
