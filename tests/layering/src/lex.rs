//! Rust source as far as module paths go: comments and strings blanked,
//! then tokens (identifiers, `::`, punctuation) with their lines.

/// The source with comments, strings and character literals blanked
/// (newlines kept, so offsets still give lines).
pub fn strip(src: &str) -> String {
    blank(src, true)
}

/// The source with comments blanked and strings kept (newlines kept): a
/// line that is blank here is a blank or comment line.
pub fn strip_comments(src: &str) -> String {
    blank(src, false)
}

fn blank(src: &str, strings: bool) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = c.clone();
    let blank = |out: &mut Vec<char>, a: usize, b: usize| {
        for ch in out.iter_mut().take(b.min(c.len())).skip(a) {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    // Strings and character literals: blanked only when asked for.
    let literal = |out: &mut Vec<char>, a: usize, b: usize| {
        if strings {
            blank(out, a, b);
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(k).copied().unwrap_or('\0');
        if at(i) == '/' && at(i + 1) == '/' {
            let mut j = i;
            while j < c.len() && c[j] != '\n' {
                j += 1;
            }
            blank(&mut out, i, j);
            i = j;
        } else if at(i) == '/' && at(i + 1) == '*' {
            let (mut depth, mut j) = (1, i + 2);
            while j < c.len() && depth > 0 {
                if at(j) == '/' && at(j + 1) == '*' {
                    depth += 1;
                    j += 2;
                } else if at(j) == '*' && at(j + 1) == '/' {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if (at(i) == 'r' || (at(i) == 'b' && at(i + 1) == 'r'))
            && (i == 0 || !ident(c[i - 1]))
            && {
                let mut k = i + if at(i) == 'b' { 2 } else { 1 };
                while at(k) == '#' {
                    k += 1;
                }
                at(k) == '"'
            }
        {
            // A raw string: r"…", r#"…"#, br"…".
            let mut k = i + if at(i) == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while at(k) == '#' {
                hashes += 1;
                k += 1;
            }
            let mut j = k + 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|h| at(j + 1 + h) == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            literal(&mut out, i, j);
            i = j;
        } else if at(i) == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            literal(&mut out, i, j + 1);
            i = j + 1;
        } else if at(i) == '\'' {
            // A character literal ('a', '\n', '\u{1F600}'), or a lifetime.
            if at(i + 1) == '\\' {
                let mut j = i + 2;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                literal(&mut out, i, j + 1);
                i = j + 1;
            } else if at(i + 2) == '\'' {
                literal(&mut out, i, i + 3);
                i += 3;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out.into_iter().collect()
}

/// A token: what module paths are made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Tokens of stripped code with the line each is on (numbers are left out).
pub fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = code.chars().collect();
    let (mut out, mut i, mut line) = (Vec::new(), 0, 1);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphabetic() || ch == '_' {
            let mut j = i;
            while j < c.len() && (c[j].is_alphanumeric() || c[j] == '_') {
                j += 1;
            }
            out.push((Tok::Ident(c[i..j].iter().collect()), line));
            i = j;
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// Whether a token is the identifier `word`.
pub fn is_ident(t: Option<&(Tok, usize)>, word: &str) -> bool {
    matches!(t, Some((Tok::Ident(w), _)) if w == word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(src: &str) -> Vec<String> {
        tokens(&strip(src))
            .into_iter()
            .filter_map(|(t, _)| match t {
                Tok::Ident(w) => Some(w),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn comments_and_strings_are_blanked_lines_kept() {
        let src = "a /* x /* nested crate::y */ still */ b // c\n\"s::t\" d\n";
        let out = strip(src);
        assert_eq!(out.len(), src.len());
        assert_eq!(out.lines().count(), src.lines().count());
        assert_eq!(words(src), ["a", "b", "d"]);
    }

    #[test]
    fn raw_strings_and_characters_are_blanked() {
        let src = r####"x r#"crate::a "quoted" "# y br"b" z '{' '\n' 'a' q<'l>"####;
        assert_eq!(words(src), ["x", "y", "z", "q", "l"]);
        // The braces and quotes inside literals are gone.
        assert!(!strip(src).contains('{'));
    }

    #[test]
    fn strip_comments_keeps_strings() {
        let src = "let s = \"// not a comment\"; // a comment\n/* b */\n";
        let out = strip_comments(src);
        assert!(out.contains("\"// not a comment\""));
        assert!(!out.contains("a comment\n"));
        assert_eq!(out.lines().nth(1).map(str::trim), Some(""));
    }

    #[test]
    fn tokens_carry_their_lines() {
        let toks = tokens("a::b\n\n{ 12 c }");
        assert_eq!(
            toks,
            [
                (Tok::Ident("a".into()), 1),
                (Tok::Path, 1),
                (Tok::Ident("b".into()), 1),
                (Tok::Punct('{'), 3),
                (Tok::Ident("c".into()), 3),
                (Tok::Punct('}'), 3),
            ]
        );
        assert!(is_ident(toks.first(), "a"));
        assert!(!is_ident(toks.get(1), "a"));
    }
}
