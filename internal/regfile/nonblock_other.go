//go:build !unix

package regfile

const nonBlock = 0
