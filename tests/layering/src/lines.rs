//! Which lines are code and which are tests: `#[cfg(test)]` modules and
//! items, and a file's lines of code besides its tests.

use crate::lex::{Tok, strip, strip_comments, tokens};

/// The first and last lines of each `#[cfg(test)] mod … { … }` block.
pub fn test_blocks(toks: &[(Tok, usize)]) -> Vec<(usize, usize)> {
    let cfg_test = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
        Tok::Ident("mod".into()),
    ];
    let mut out = Vec::new();
    let mut i = 0;
    while i + cfg_test.len() + 2 <= toks.len() {
        let here = toks[i..i + cfg_test.len()]
            .iter()
            .map(|t| &t.0)
            .eq(cfg_test.iter());
        let open = i + cfg_test.len() + 1;
        if here && toks[open].0 == Tok::Punct('{') {
            let mut depth = 0;
            let mut j = open;
            while j < toks.len() {
                match toks[j].0 {
                    Tok::Punct('{') => depth += 1,
                    Tok::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            let end = toks.get(j).map_or(toks[open].1, |t| t.1);
            out.push((toks[i].1, end));
            i = j;
        }
        i += 1;
    }
    out
}

/// Lines in `#[cfg(test)] mod … { … }` blocks.
pub fn test_lines(toks: &[(Tok, usize)]) -> usize {
    test_blocks(toks).iter().map(|(a, b)| b - a + 1).sum()
}

/// Lines of code: not blank, not only a comment, and not in a
/// `#[cfg(test)] mod … { … }` block.
pub fn code_lines(text: &str) -> usize {
    let blocks = test_blocks(&tokens(&strip(text)));
    strip_comments(text)
        .lines()
        .enumerate()
        .filter(|(n, line)| {
            let n = n + 1;
            !line.trim().is_empty() && !blocks.iter().any(|(a, b)| (*a..=*b).contains(&n))
        })
        .count()
}

/// The token ranges (first and last index) of the items under
/// `#[cfg(test)]`: a module, a `mod x;` declaration, a function, a `use`.
/// An inner `#![cfg(test)]` makes the whole file one.
pub fn cfg_test_items(toks: &[(Tok, usize)]) -> Vec<(usize, usize)> {
    let kind = |i: usize| toks.get(i).map(|t| &t.0);
    let cfg_test = |i: usize| -> Option<usize> {
        // `#[cfg(test)]` or `#![cfg(test)]`: the index after it.
        let mut k = i + 1;
        if kind(k) == Some(&Tok::Punct('!')) {
            k += 1;
        }
        let want = [
            Tok::Punct('['),
            Tok::Ident("cfg".into()),
            Tok::Punct('('),
            Tok::Ident("test".into()),
            Tok::Punct(')'),
            Tok::Punct(']'),
        ];
        want.iter()
            .enumerate()
            .all(|(n, t)| kind(k + n) == Some(t))
            .then_some(k + want.len())
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if kind(i) != Some(&Tok::Punct('#')) {
            i += 1;
            continue;
        }
        let Some(mut k) = cfg_test(i) else {
            i += 1;
            continue;
        };
        if kind(i + 1) == Some(&Tok::Punct('!')) {
            return vec![(0, toks.len().saturating_sub(1))];
        }
        // Further attributes.
        while kind(k) == Some(&Tok::Punct('#')) && kind(k + 1) == Some(&Tok::Punct('[')) {
            k = close(toks, k + 1, '[', ']') + 1;
        }
        // The item: to its `;` or to the `}` of its body.
        let mut depth = 0i32;
        let mut end = k;
        while end < toks.len() {
            match toks[end].0 {
                Tok::Punct('(' | '[') => depth += 1,
                Tok::Punct(')' | ']') => depth -= 1,
                Tok::Punct(';') if depth <= 0 => break,
                Tok::Punct('{') if depth <= 0 => {
                    end = close(toks, end, '{', '}');
                    break;
                }
                _ => {}
            }
            end += 1;
        }
        let end = end.min(toks.len().saturating_sub(1));
        out.push((i, end));
        i = end + 1;
    }
    out
}

/// The index of the bracket that closes the one at `open`.
fn close(toks: &[(Tok, usize)], open: usize, left: char, right: char) -> usize {
    let mut depth = 0;
    for (j, (t, _)) in toks.iter().enumerate().skip(open) {
        if *t == Tok::Punct(left) {
            depth += 1;
        } else if *t == Tok::Punct(right) {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    toks.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "//! A module.\n\
        \n\
        use std::fmt;\n\
        /// Doc.\n\
        pub fn f() -> &'static str {\n\
        \x20   \"// a string, not a comment\"\n\
        }\n\
        /* a block\n\
        comment */\n\
        #[cfg(test)]\n\
        mod tests {\n\
        \x20   use super::*;\n\
        \x20   #[test]\n\
        \x20   fn t() { let _ = '}'; }\n\
        }\n\
        fn g() {}\n";

    #[test]
    fn a_cfg_test_module_is_not_code() {
        let toks = tokens(&strip(SRC));
        assert_eq!(test_blocks(&toks), [(10, 15)]);
        assert_eq!(test_lines(&toks), 6);
        // use, fn f, the string, its brace, fn g.
        assert_eq!(code_lines(SRC), 5);
    }

    #[test]
    fn cfg_test_items_reach_their_end() {
        let src = "#[cfg(test)]\n#[allow(dead_code)]\nmod tests;\nfn a() {}\n#[cfg(test)]\nfn b(x: [u8; 2]) { c(); }\n#[cfg(test)]\nuse crate::x;\n";
        let toks = tokens(&strip(src));
        let lines: Vec<(usize, usize)> = cfg_test_items(&toks)
            .into_iter()
            .map(|(a, b)| (toks[a].1, toks[b].1))
            .collect();
        assert_eq!(lines, [(1, 3), (5, 6), (7, 8)]);
        let whole = tokens("#![cfg(test)]\nfn a() {}");
        assert_eq!(cfg_test_items(&whole), [(0, whole.len() - 1)]);
    }
}
