//go:build !pglockapi

package cli

import "github.com/spf13/cobra"

func (a *app) addDemoCommands(*cobra.Command) {}
